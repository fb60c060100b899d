"""The server's OpenAPI 3 schema (hand-written; a test checks it lists every route)."""

from __future__ import annotations

_ERR = {"description": "error", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}}}}}
_BEARER = [{"bearer": []}]
_OBJ = {"type": "object"}


def _json_body(props: dict, required: list[str]) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": required, "properties": props}}}}


def _ok(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _OBJ}}}


def openapi_schema() -> dict:
    """The schema served at GET /openapi.json."""
    sid = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    token = {"name": "token", "in": "query", "required": False, "schema": {"type": "string"},
             "description": "session token (instead of the API key)"}
    s = {"type": "string"}
    session_op = {"security": _BEARER, "parameters": [sid, token]}
    images = ("image/png", "image/jpeg", "image/webp", "video/mp4", "video/quicktime",
              "video/webm", "video/x-matroska")
    audio = ("audio/wav", "audio/mpeg", "audio/flac", "audio/ogg", "audio/mp4", "audio/webm")
    return {
        "openapi": "3.0.3",
        "info": {"title": "avatarstream", "version": "1",
                 "description": "Live talking-avatar sessions: upload a reference once (encoded "
                                "once, kept across restarts), open sessions, watch over WebRTC "
                                "(or HLS), speak through PCM16 over a WebSocket or text (TTS); "
                                "render files with progress."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/": {"get": {"summary": "the web page", "responses": {"200": {
                "description": "HTML"}}}},
            "/openapi.json": {"get": {"summary": "this schema", "responses": {"200": {
                "description": "OpenAPI document"}}}},
            "/v1/server": {"get": {"summary": "model, measured capacity, live sessions, load",
                                   "responses": {"200": _ok("server state")}}},
            "/v1/voices": {"get": {"summary": "the text-to-speech voices",
                                   "responses": {"200": _ok("voices and the default")}}},
            "/v1/avatars": {"post": {
                "summary": "upload a reference image or video; encoded once; returns its id",
                "security": _BEARER,
                "requestBody": {"required": True, "content": {
                    t: {"schema": {"type": "string", "format": "binary"}} for t in images}},
                "responses": {"201": _ok("the avatar"), "400": _ERR, "401": _ERR,
                              "413": _ERR, "415": _ERR}}},
            "/v1/avatars/{id}": {"get": {
                "summary": "an avatar of this API key (404 for another key's)",
                "security": _BEARER, "parameters": [sid],
                "responses": {"200": _ok("the avatar"), "401": _ERR, "404": _ERR}}},
            "/v1/sessions": {"post": {
                "summary": "open a live session on an avatar -> {session_id, token, urls}; "
                           "503 when it could not be served in real time",
                "security": _BEARER,
                "requestBody": _json_body({"avatar_id": s, "hls": {"type": "boolean"}},
                                          ["avatar_id"]),
                "responses": {"201": _ok("session_id, token, audio/offer/say/hls URLs"),
                              "400": _ERR, "401": _ERR, "404": _ERR, "503": _ERR}}},
            "/v1/sessions/{id}": {
                "get": {"summary": "session state: idle/talking/ended, media time, lag, events",
                        **session_op, "responses": {"200": _ok("state"), "401": _ERR,
                                                    "404": _ERR}},
                "delete": {"summary": "end the session and remove its files", **session_op,
                           "responses": {"204": {"description": "ended"}, "401": _ERR,
                                         "404": _ERR}}},
            "/v1/sessions/{id}/offer": {"post": {
                "summary": "WebRTC: the viewer's offer (receive one video + one audio track) "
                           "-> the answer; ICE candidates are in the SDP (no trickle, no STUN)",
                **session_op, "requestBody": _json_body({"sdp": s, "type": s}, ["sdp"]),
                "responses": {"200": _ok("{sdp, type: answer}"), "400": _ERR, "401": _ERR,
                              "404": _ERR}}},
            "/v1/sessions/{id}/say": {"post": {
                "summary": "speak a text (TTS: espeak-ng / flite voices, piper if configured)",
                **session_op, "requestBody": _json_body({"text": s, "voice": s}, ["text"]),
                "responses": {"202": _ok("{seconds} queued"), "400": _ERR, "401": _ERR,
                              "404": _ERR}}},
            "/v1/sessions/{id}/{action}": {"post": {
                "summary": "interrupt (clear_buffer: stops speaking within one chunk) | "
                           "end_of_speech | keep_alive",
                **session_op,
                "parameters": [sid, token, {"name": "action", "in": "path", "required": True,
                                            "schema": {"type": "string", "enum": [
                                                "interrupt", "end_of_speech", "keep_alive"]}}],
                "responses": {"200": _ok("interrupt: {dropped_s}"),
                              "204": {"description": "done"}, "401": _ERR, "404": _ERR}}},
            "/v1/sessions/{id}/audio": {"get": {
                "summary": "WebSocket: binary PCM16 mono 16 kHz speech; JSON text messages "
                           "{type: end_of_speech | clear_buffer | keep_alive | text}. The server "
                           "answers {type: slow_down} when a packet does not fit the speech "
                           "buffer (send it again later), {type: cleared, dropped_s}, and sends "
                           "the session's events: playout, speech_started, speech_ended, "
                           "session_ended (with media_s, the session media time).",
                **session_op,
                "responses": {"101": {"description": "WebSocket upgrade"}, "401": _ERR,
                              "404": _ERR}}},
            "/v1/sessions/{id}/hls/{name}": {"get": {
                "summary": "the session's live HLS (fMP4): index.m3u8, init.mp4, "
                           "segment_NNNNN.m4s",
                "parameters": [sid, {"name": "name", "in": "path", "required": True,
                                     "schema": s}, token],
                "responses": {"200": {"description": "playlist or segment"}, "401": _ERR,
                              "404": _ERR}}},
            "/v1/renders": {"post": {
                "summary": "render a file (non-live): JSON {avatar_id, text, voice} or the "
                           "speech as the body with ?avatar_id=",
                "security": _BEARER,
                "parameters": [{"name": "avatar_id", "in": "query", "required": False,
                                "schema": s}],
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"type": "object", "properties": {
                        "avatar_id": s, "text": s, "voice": s}}},
                    **{t: {"schema": {"type": "string", "format": "binary"}} for t in audio}}},
                "responses": {"202": _ok("the job"), "400": _ERR, "401": _ERR, "404": _ERR,
                              "413": _ERR, "415": _ERR}}},
            "/v1/renders/{id}": {
                "get": {"summary": "job state and progress", "security": _BEARER,
                        "parameters": [sid],
                        "responses": {"200": _ok("state, progress, frames, fps"), "401": _ERR,
                                      "404": _ERR}},
                "delete": {"summary": "cancel / forget the job and its file",
                           "security": _BEARER, "parameters": [sid],
                           "responses": {"204": {"description": "removed"}, "401": _ERR,
                                         "404": _ERR}}},
            "/v1/renders/{id}/output": {"get": {
                "summary": "the rendered MP4 (playable while it is written)", "security": _BEARER,
                "parameters": [sid],
                "responses": {"200": {"description": "video/mp4"}, "401": _ERR, "404": _ERR}}},
        },
    }
