"""The server's OpenAPI 3 document (hand-written): every route (a test checks), every status it
can answer, the body of each (errors are `{"error": message}`), and the request limits it runs
with (`x-limits`, and as `maxLength` where a schema can say it). tests/serve/test_fuzz.py
generates requests from it (schemathesis) and checks every answer against it.
"""

from __future__ import annotations

from avatarstream.serve.limits import Limits, describe_limits

S, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
HEX_ID = {"type": "string", "pattern": "^[0-9a-f]{24}$"}
_BEARER = [{"bearer": []}]


def _obj(props: dict, required: list[str] | None = None, *, closed: bool = False) -> dict:
    """An object schema; `required` None: every property."""
    out = {"type": "object", "properties": props,
           "required": list(props) if required is None else required}
    return {**out, "additionalProperties": False} if closed else out


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


ERROR = _obj({"error": S})
AVATAR = _obj({"id": HEX_ID, "created": NUM, "frames": INT,
               "size": {"oneOf": [INT, {"type": "string", "pattern": "^[0-9]+x[0-9]+$"}]},
               "is_image": BOOL, "content_type": S})
SESSION = _obj({"session_id": HEX_ID, "token": S, "audio_url": S, "offer_url": S, "say_url": S,
                "hls_url": _nullable(S), "rtmp": _nullable(S), "sample_rate": INT, "fps": INT,
                "playout_delay_s": NUM})
SESSION_STATE = _obj({
    "state": {"type": "string", "enum": ["idle", "talking", "listening", "ended"]}, "media_s": NUM,
    "lag_s": NUM, "buffered_s": NUM, "utterances": INT, "viewer": BOOL,
    "playout_start_s": _nullable(NUM), "late_frames": INT, "rtmp": _nullable({"type": "object"}),
    "events": {"type": "array", "items": _obj({"type": S}, ["type"])}})
RENDER = _obj({"id": HEX_ID, "state": {"type": "string", "enum": [
    "queued", "running", "done", "failed", "cancelled"]}, "frames": INT, "total_frames": INT,
    "progress": NUM, "elapsed_s": NUM, "fps": NUM, "error": _nullable(S), "output_url": S,
    "content_credentials": _nullable({"type": "object"})})
SERVER = _obj({"model": S, "capacity": _nullable({"type": "object"}), "live_sessions": INT,
               "refused": INT, "playout_delay_s": NUM, "scheduler": {"type": "object"}})
VOICES = _obj({"default": S, "voices": {"type": "array", "items": _obj(
    {"id": S, "engine": S, "language": S})}})
ANSWER = _obj({"sdp": S, "type": {"type": "string", "enum": ["answer"]}})
QUEUED = _obj({"type": {"type": "string", "enum": ["queued"]}, "seconds": NUM})
CLEARED = _obj({"type": {"type": "string", "enum": ["cleared"]}, "dropped_s": NUM})

_WHY = {400: "a malformed request or unusable input", 401: "no (accepted) bearer key",
        404: "not found, or not this key's", 413: "the body is over its limit",
        415: "an unsupported Content-Type",
        429: "too many RTMP targets checked for this key or server (Retry-After)",
        501: "WebRTC is not installed on the server",
        503: "no capacity for one more live session (Retry-After)",
        507: "the server's disk is full"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _answers(ok: dict[int, dict | None], *errors: int) -> dict:
    """Responses: the successes (a description-only dict, or a schema as JSON) and the errors."""
    out = {str(code): ({"description": "no content"} if schema is None else schema)
           for code, schema in ok.items()}
    # any request can be malformed (400)
    for code in sorted({400, *errors}):
        out[str(code)] = _json(ERROR, _WHY[code])
    return out


def _body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _binary(types: tuple[str, ...]) -> dict:
    return {"required": True, "content": {
        t: {"schema": {"type": "string", "format": "binary"}} for t in types}}


def openapi_schema(limits: Limits | None = None) -> dict:
    """The document served at GET /openapi.json, stating `limits`."""
    limits = limits or Limits()
    text = {"type": "string", "maxLength": limits.max_text_chars}
    sid = {"name": "id", "in": "path", "required": True, "schema": HEX_ID}
    token = {"name": "token", "in": "query", "required": False, "schema": S,
             "description": "the session's token (instead of the API key)"}
    session_op = {"security": _BEARER, "parameters": [sid, token]}
    images = ("image/png", "image/jpeg", "image/webp", "video/mp4", "video/quicktime",
              "video/webm", "video/x-matroska")
    audio = ("audio/wav", "audio/mpeg", "audio/flac", "audio/ogg", "audio/mp4", "audio/webm")
    media = {"200": {"description": "the playlist or a segment", "content": {
        "application/vnd.apple.mpegurl": {"schema": S}, "video/mp4": {"schema": S}}}}
    mp4 = {"200": {"description": "the MP4", "content": {"video/mp4": {"schema": S}}}}
    stated = describe_limits(limits)
    return {
        "openapi": "3.0.3",
        "info": {"title": "avatarstream", "version": "1",
                 "description": "Live talking-avatar sessions: upload a reference once (encoded "
                                "once, kept across restarts), open sessions, watch over WebRTC "
                                "(or HLS), speak through PCM16 over a WebSocket or text (TTS); "
                                "render files with progress. Limits on what one request may "
                                "cost (x-limits): " + "; ".join(
                                    f"{k} = {v['value']} ({v['option']})" for k, v in stated.items()),
                 "x-limits": stated},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/": {"get": {"summary": "the web page", "responses": {"200": {
                "description": "HTML", "content": {"text/html": {"schema": S}}}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {
                "200": _json({"type": "object"}, "OpenAPI document")}}},
            "/v1/server": {"get": {"summary": "model, measured capacity, live sessions, load "
                                              "(needs a key when the server has --api-key)",
                                   "security": _BEARER,
                                   "responses": _answers({200: _json(SERVER, "server state")}, 401)}},
            "/v1/voices": {"get": {"summary": "the text-to-speech voices",
                                   "responses": _answers({200: _json(VOICES, "voices")})}},
            "/v1/avatars": {"post": {
                "summary": "upload a reference image or video; encoded once; returns its id",
                "security": _BEARER, "requestBody": _binary(images),
                "responses": _answers({201: _json(AVATAR, "the avatar")}, 401, 413, 415, 507)}},
            "/v1/avatars/{id}": {"get": {
                "summary": "an avatar of this API key (404 for another key's)",
                "security": _BEARER, "parameters": [sid],
                "responses": _answers({200: _json(AVATAR, "the avatar")}, 401, 404)}},
            "/v1/sessions": {"post": {
                "summary": "open a live session on an avatar; 503 when it could not be served "
                           "in real time", "security": _BEARER,
                "requestBody": _body(_obj({"avatar_id": S, "hls": BOOL, "rtmp_url": S}, ["avatar_id"])),
                "responses": _answers({201: _json(SESSION, "the session, its token and URLs")},
                                      401, 404, 413, 429, 503, 507)}},
            "/v1/sessions/{id}": {
                "get": {"summary": "session state: idle/talking/listening/ended, media time, lag, events",
                        **session_op,
                        "responses": _answers({200: _json(SESSION_STATE, "state")}, 401, 404)},
                "delete": {"summary": "end the session and remove its files", **session_op,
                           "responses": _answers({204: None}, 401, 404)}},
            "/v1/sessions/{id}/offer": {"post": {
                "summary": "WebRTC: the viewer's offer (receive one video + one audio track) "
                           "-> the answer; ICE candidates are in the SDP (no trickle, no STUN)",
                **session_op, "requestBody": _body(_obj({"sdp": S, "type": S}, ["sdp"])),
                "responses": _answers({200: _json(ANSWER, "the answer")}, 401, 404, 413, 501)}},
            "/v1/sessions/{id}/say": {"post": {
                "summary": "speak a text (TTS: espeak-ng / flite voices, piper if configured)",
                **session_op, "requestBody": _body(_obj({"text": text, "voice": S}, ["text"])),
                "responses": _answers({202: _json(QUEUED, "queued")}, 401, 404, 413)}},
            "/v1/sessions/{id}/{action}": {"post": {
                "summary": "interrupt (clear_buffer: stops speaking within one chunk) | "
                           "end_of_speech | keep_alive",
                "security": _BEARER,
                "parameters": [sid, token, {"name": "action", "in": "path", "required": True,
                                            "schema": {"type": "string", "enum": [
                                                "interrupt", "end_of_speech", "keep_alive"]}}],
                "responses": _answers({200: _json(CLEARED, "interrupt: what was dropped"),
                                       204: None}, 401, 404)}},
            "/v1/sessions/{id}/audio": {"get": {
                "summary": "WebSocket: binary PCM16 mono 16 kHz speech, packets of at most "
                           f"{limits.max_packet_bytes} bytes (a larger one closes the socket "
                           "with 1009 and a reason); JSON text messages {type: end_of_speech | "
                           "clear_buffer | keep_alive | text} and {type: listening, on: true | "
                           "false} (the user started / stopped speaking: the avatar listens, "
                           "mouth closed, idle motion; queued speech still plays, clear_buffer "
                           "cuts it). The server answers {type: "
                           "slow_down} when a packet does not fit the speech buffer (send it "
                           "again later), {type: cleared, dropped_s}, {type: error, error}, and "
                           "sends the session's events: playout, speech_started, speech_ended, "
                           "listening (on, media_s), session_ended (with media_s, and error when "
                           "it ended on one). A stopping server closes the socket with 1001.",
                **session_op,
                "responses": _answers({101: {"description": "WebSocket upgrade"}}, 401, 404)}},
            "/v1/sessions/{id}/hls/{name}": {"get": {
                "summary": "the session's live HLS (fMP4): index.m3u8, init.mp4, "
                           "segment_NNNNN.m4s", "security": _BEARER,
                "parameters": [sid, {"name": "name", "in": "path", "required": True, "schema": {
                    "type": "string", "pattern": r"^(index\.m3u8|init\.mp4|segment_\d{5}\.m4s)$"}},
                    token],
                "responses": _answers(media, 401, 404)}},
            "/v1/renders": {"post": {
                "summary": "render a file (non-live): JSON {avatar_id, text, voice} or the "
                           "speech as the body with ?avatar_id=", "security": _BEARER,
                "parameters": [{"name": "avatar_id", "in": "query", "required": False,
                                "schema": S}],
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _obj({"avatar_id": S, "text": text,
                                                         "voice": S}, ["avatar_id", "text"])},
                    **_binary(audio)["content"]}},
                "responses": _answers({202: _json(RENDER, "the job")}, 401, 404, 413, 415, 507)}},
            "/v1/renders/{id}": {
                "get": {"summary": "job state and progress (kept across restarts)",
                        "security": _BEARER, "parameters": [sid],
                        "responses": _answers({200: _json(RENDER, "the job")}, 401, 404)},
                "delete": {"summary": "cancel / forget the job and its file",
                           "security": _BEARER, "parameters": [sid],
                           "responses": _answers({204: None}, 401, 404)}},
            "/v1/renders/{id}/output": {"get": {
                "summary": "the rendered MP4 (playable while it is written)", "security": _BEARER,
                "parameters": [sid], "responses": _answers(mp4, 401, 404)}},
        },
    }

