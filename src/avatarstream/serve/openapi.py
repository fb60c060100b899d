"""The server's OpenAPI 3 schema (hand-written; a test checks it lists every route)."""

from __future__ import annotations

_ERR = {"description": "error", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}}}}}
_BEARER = [{"bearer": []}]


def openapi_schema() -> dict:
    """The schema served at GET /openapi.json."""
    sid = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    token = {"name": "token", "in": "query", "required": False, "schema": {"type": "string"},
             "description": "session token (instead of the API key)"}
    return {
        "openapi": "3.0.3",
        "info": {"title": "avatarstream", "version": "1",
                 "description": "Live avatar sessions: upload a reference once, open sessions, "
                                "stream speech (PCM16 mono 16 kHz) over a WebSocket, watch HLS."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/openapi.json": {"get": {"summary": "this schema", "responses": {"200": {
                "description": "OpenAPI document"}}}},
            "/v1/avatars": {"post": {
                "summary": "upload a reference image or video; prepared once; returns its id",
                "security": _BEARER,
                "requestBody": {"required": True, "content": {
                    t: {"schema": {"type": "string", "format": "binary"}} for t in (
                        "image/png", "image/jpeg", "image/webp", "video/mp4", "video/quicktime",
                        "video/webm", "video/x-matroska")}},
                "responses": {"201": {"description": "the avatar"}, "400": _ERR, "401": _ERR,
                              "413": _ERR, "415": _ERR}}},
            "/v1/avatars/{id}": {"get": {
                "summary": "an avatar of this API key (404 for another key's)",
                "security": _BEARER, "parameters": [sid],
                "responses": {"200": {"description": "the avatar"}, "401": _ERR, "404": _ERR}}},
            "/v1/sessions": {"post": {
                "summary": "open a live session on an avatar: {avatar_id} -> {session_id, token}",
                "security": _BEARER,
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["avatar_id"],
                    "properties": {"avatar_id": {"type": "string"}}}}}},
                "responses": {"201": {"description": "session_id, token, hls and audio URLs"},
                              "400": _ERR, "401": _ERR, "404": _ERR}}},
            "/v1/sessions/{id}": {"delete": {
                "summary": "end the session and remove its files", "security": _BEARER,
                "parameters": [sid, token],
                "responses": {"204": {"description": "ended"}, "401": _ERR, "404": _ERR}}},
            "/v1/sessions/{id}/audio": {"get": {
                "summary": "WebSocket: binary PCM16 mono 16 kHz speech; JSON text messages "
                           "{type: end_of_speech | clear_buffer | keep_alive}. The server answers "
                           "{type: slow_down} when a packet does not fit the speech buffer "
                           "(send it again later) and {type: cleared, dropped_s} to clear_buffer.",
                "parameters": [sid, token],
                "responses": {"101": {"description": "WebSocket upgrade"}, "401": _ERR,
                              "404": _ERR}}},
            "/v1/sessions/{id}/hls/{name}": {"get": {
                "summary": "the session's live HLS: index.m3u8 and its MPEG-TS segments",
                "parameters": [sid, {"name": "name", "in": "path", "required": True,
                                     "schema": {"type": "string"}}, token],
                "responses": {"200": {"description": "playlist or segment"}, "401": _ERR,
                              "404": _ERR}}},
        },
    }
