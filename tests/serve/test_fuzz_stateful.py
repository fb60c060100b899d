"""Stateful fuzzing of the server (issue 37): a hypothesis state machine that uploads avatars,
opens sessions and renders, uses every sub-resource of a live one (say, offer, interrupt,
end_of_speech, keep_alive, the audio WebSocket, HLS, the render's output) with bodies generated
from the served OpenAPI document (schemathesis: positive and negative) or valid ones, then
deletes them. Every answer is checked against the document (status, content type, body schema,
negative data refused) and is never a 5xx.

It then ASSERTS that every operation of the document reached its success code at least once
(the per-operation table of status codes is printed), and FAILS when its time budget runs out
before the planned steps are done. A RuntimeError injected into a handler's success path (the
handler answered 2xx; the injection raises instead) makes it fail: the tests at the end prove
it for `POST /say` and `GET /v1/renders/{id}/output` (run by hand for every HTTP operation of
the document, each made it fail).

The server runs in this process (the same `make_app` `avatarstream serve` runs, on a loopback
port, in a thread), so a handler can be replaced while it runs."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import aiohttp
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test
from schemathesis import checks
from schemathesis.generation import GenerationMode

from avatarstream.serve.openapi import openapi_schema

from .helpers import _png, _wav
from .inprocess import INJECT, ErrorLog, InProcessServer, offer, plain

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PACKET = 4096
EXAMPLES, STEPS = 6, 30  # hypothesis examples (each a fresh machine) x steps per example
BUDGET_S = 150.0  # the planned steps take 20-30 s on a 2-core CPU
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.negative_data_rejection]
EVENTS = {"slow_down", "cleared", "queued", "error", "playout", "speech_started",
          "speech_ended", "session_ended"}


def _limits():  # type: ignore[no-untyped-def]
    from avatarstream.serve.limits import Limits

    return Limits(max_text_chars=120, max_render_seconds=4.0, max_json_bytes=16 * 1024,
                  max_packet_bytes=PACKET)


DOCUMENT = openapi_schema(_limits())
schemathesis.serializer.alias(["image/png", "audio/wav"], "application/octet-stream")
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)


def _targets() -> list[str]:
    """Every operation of the document (the actions of /{action} each on its own)."""
    out = []
    for path, methods in DOCUMENT["paths"].items():
        for method, op in methods.items():
            if "{action}" in path:
                enum = next(p for p in op["parameters"] if p["name"] == "action")["schema"]["enum"]
                out += [f"{method.upper()} {path.replace('{action}', a)}" for a in enum]
            else:
                out.append(f"{method.upper()} {path}")
    return out


TARGETS = _targets()


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    from avatarstream.live.session import LiveSessionConfig
    from avatarstream.registry import load_model
    from avatarstream.serve.app import make_app
    from avatarstream.serve.config import ServerConfig
    from avatarstream.serve.webrtc import use_host_addresses

    use_host_addresses(["127.0.0.1"])
    models = load_model("tiny-random")
    models.config.steps = 1
    config = ServerConfig(data_dir=tmp_path_factory.mktemp("stateful") / "data",
                          api_keys=frozenset({KEY}), limits=_limits(),
                          session=LiveSessionConfig(idle_timeout_s=30.0, lead_s=0.3),
                          hls_segment_seconds=0.5, max_sessions=2, playout_delay_s=0.3,
                          rtmp_allow=())  # fuzzed rtmp_urls never make it connect anywhere
    errors = ErrorLog()
    for name in ("avatarstream", "aiohttp"):
        logging.getLogger(name).addHandler(errors)
    s = InProcessServer(make_app(models, config))
    s.thread.start()
    assert s.ready.wait(300), "the server did not start"
    s.errors = errors
    s.offer = asyncio.run(offer())
    s.avatar = plain(AUTH, "POST", s.url + "/v1/avatars", _png(), "image/png").json()["id"]
    yield s
    s.loop.call_soon_threadsafe(s.loop.stop)
    s.thread.join(60)
    for name in ("avatarstream", "aiohttp"):
        logging.getLogger(name).removeHandler(errors)


@dataclass
class Run:
    """One run of the machine: where, until when, and the statuses each operation got."""

    server: InProcessServer
    deadline: float
    statuses: defaultdict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    spent: bool = False
    steps: int = 0

    def table(self) -> str:
        rows = [f"{'operation':<44} {'2xx':>4}  statuses"]
        for op in TARGETS:
            c = self.statuses[op]
            ok = sum(n for code, n in c.items() if 200 <= code < 300 or code == 101)
            rows.append(f"{op:<44} {ok:>4}  {dict(sorted(c.items()))}")
        return "\n".join(rows)

    def missing(self) -> list[str]:
        return [op for op in TARGETS
                if not any(200 <= code < 300 or code == 101 for code in self.statuses[op])]


RUN: Run | None = None  # the run the machine reports to (hypothesis makes the machines)
_STRATEGIES: dict = {}


def _fuzzed(data, label: str):  # type: ignore[no-untyped-def]
    """A case of operation `label` generated from the document, positive or negative."""
    mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
    if (label, mode) not in _STRATEGIES:
        method, path = label.split(" ", 1)
        _STRATEGIES[label, mode] = SCHEMA[path][method].as_strategy(generation_mode=mode)
    return data.draw(_STRATEGIES[label, mode])


def _case(label: str, **kw):  # type: ignore[no-untyped-def]
    method, path = label.split(" ", 1)
    return SCHEMA[path][method].Case(**kw)


def _send(case, label: str, real: dict | None = None):  # type: ignore[no-untyped-def]
    """Send `case` with the `real` path parameters (a live session's or render's id) unless its
    path was generated negative (then it goes as generated), count its status, check it."""
    from schemathesis.core.parameters import ParameterLocation

    assert RUN is not None
    if real and not (case.meta is not None and case.meta.is_negative_at(ParameterLocation.PATH)):
        case.path_parameters = {**(case.path_parameters or {}), **real}
    if "{action}" in label:
        label = label.replace("{action}", str(case.path_parameters.get("action")))
    response = case.call(base_url=RUN.server.url, headers=AUTH, timeout=60)
    RUN.statuses[label][response.status_code] += 1
    headers = {**AUTH, **(case.headers or {})}
    excluded = []
    if (label == "POST /v1/sessions" and response.status_code == 503
            and "retry-after" in response.headers):  # documented: the server is full
        excluded.append(checks.not_a_server_error)
    if case.meta is not None and any(case.meta.is_negative_at(where) for where in (
            ParameterLocation.QUERY, ParameterLocation.HEADER)):
        # the key sent replaces a generated header, and query parameters the server does not
        # know are ignored (the id is real): such a request is a valid one
        excluded.append(checks.negative_data_rejection)
    case.validate_response(response, headers=headers, checks=CHECKS,
                           excluded_checks=excluded or None)
    return response


class ServerMachine(RuleBasedStateMachine):
    """Avatars, sessions and renders: created, used with valid and generated requests, deleted.

    One rule draws each step's action from those the state allows (hypothesis' swarm testing
    switches whole rules off per example, which would leave operations unreached). Each action
    sends its valid request and, half the time, a request generated from the document first."""

    def __init__(self) -> None:
        super().__init__()
        assert RUN is not None
        self.avatars: list[str] = [RUN.server.avatar]
        self.sessions: list[dict] = []
        self.jobs: list[str] = []

    @rule(data=st.data())
    def step(self, data):  # type: ignore[no-untyped-def]
        assert RUN is not None
        if time.monotonic() > RUN.deadline:  # the rest of the run sends nothing (and fails)
            RUN.spent = True
            return
        RUN.steps += 1
        actions = ["upload_avatar", "get_avatar", "read_server", "open_session", "render"]
        if self.sessions:
            actions += ["get_session", "say", "offer", "control", "hls", "audio", "delete_session"]
        if self.jobs:
            actions += ["get_render", "render_output", "delete_render"]
        getattr(self, data.draw(st.sampled_from(actions), label="action"))(data)

    def _call(self, data, label: str, real: dict | None = None, **valid) -> list:  # type: ignore[no-untyped-def]
        """A generated request (half the time), then the valid one (`valid`: the Case's fields);
        their responses."""
        out = []
        if data.draw(st.booleans(), label="generated"):
            out.append(_send(_fuzzed(data, label), label, real))
        out.append(_send(_case(label, path_parameters=real or {}, **valid), label, real))
        return out

    def upload_avatar(self, data):  # type: ignore[no-untyped-def]
        for r in self._call(data, "POST /v1/avatars", body=_png(), media_type="image/png"):
            if r.status_code == 201:
                self.avatars.append(r.json()["id"])

    def get_avatar(self, data):  # type: ignore[no-untyped-def]
        self._call(data, "GET /v1/avatars/{id}", {"id": data.draw(st.sampled_from(self.avatars))})

    def read_server(self, data):  # type: ignore[no-untyped-def]
        self._call(data, data.draw(st.sampled_from(
            ["GET /", "GET /openapi.json", "GET /v1/server", "GET /v1/voices"])))

    def open_session(self, data):  # type: ignore[no-untyped-def]
        body = {"avatar_id": data.draw(st.sampled_from(self.avatars)), "hls": data.draw(st.booleans())}
        for r in self._call(data, "POST /v1/sessions", body=body, media_type="application/json"):
            if r.status_code == 201:
                self.sessions.append(r.json())

    def _session(self, data) -> dict:  # type: ignore[no-untyped-def]
        return data.draw(st.sampled_from(self.sessions))

    def get_session(self, data):  # type: ignore[no-untyped-def]
        self._call(data, "GET /v1/sessions/{id}", {"id": self._session(data)["session_id"]})

    def say(self, data):  # type: ignore[no-untyped-def]
        text = data.draw(st.sampled_from(["Hello there.", "One, two; three!"]))
        self._call(data, "POST /v1/sessions/{id}/say", {"id": self._session(data)["session_id"]},
                   body={"text": text}, media_type="application/json")

    def offer(self, data):  # type: ignore[no-untyped-def]
        assert RUN is not None
        self._call(data, "POST /v1/sessions/{id}/offer", {"id": self._session(data)["session_id"]},
                   body={"sdp": RUN.server.offer, "type": "offer"}, media_type="application/json")

    def control(self, data):  # type: ignore[no-untyped-def]
        """interrupt, end_of_speech and keep_alive, in an order drawn."""
        sid = self._session(data)["session_id"]
        for action in data.draw(st.permutations(["interrupt", "end_of_speech", "keep_alive"])):
            self._call(data, "POST /v1/sessions/{id}/{action}", {"id": sid, "action": action})

    def hls(self, data):  # type: ignore[no-untyped-def]
        """The playlist once published (polled), then its init segment and a media segment."""
        label, s = "GET /v1/sessions/{id}/hls/{name}", self._session(data)
        real = {"id": s["session_id"]}
        if not s["hls_url"] or data.draw(st.booleans(), label="generated"):
            _send(_fuzzed(data, label), label, real)
        if not s["hls_url"]:
            return
        until = time.monotonic() + 10.0
        while (r := _send(_case(label, path_parameters={**real, "name": "index.m3u8"}), label)
               ).status_code != 200 and time.monotonic() < until:
            time.sleep(0.25)
        segments = [x for x in r.text.splitlines() if x.startswith("segment_")][:1]
        for name in ["init.mp4", *segments]:
            _send(_case(label, path_parameters={**real, "name": name}), label)

    def audio(self, data):  # type: ignore[no-untyped-def]
        """The session's WebSocket: a speech packet and a control message get known answers."""
        assert RUN is not None
        pcm = data.draw(st.binary(min_size=2, max_size=PACKET).map(lambda b: b[: len(b) // 2 * 2]))
        control = data.draw(st.sampled_from(["keep_alive", "end_of_speech", "clear_buffer"]))
        asyncio.run(_converse(RUN.server.url + self._session(data)["audio_url"], pcm, control))
        RUN.statuses["GET /v1/sessions/{id}/audio"][101] += 1

    def delete_session(self, data):  # type: ignore[no-untyped-def]
        s = self._session(data)
        self.sessions.remove(s)
        self._call(data, "DELETE /v1/sessions/{id}", {"id": s["session_id"]})

    def render(self, data):  # type: ignore[no-untyped-def]
        label, avatar = "POST /v1/renders", data.draw(st.sampled_from(self.avatars))
        if data.draw(st.booleans(), label="speech"):
            got = self._call(data, label, body=_wav(0.6), media_type="audio/wav",
                             query={"avatar_id": avatar})
        else:
            got = self._call(data, label, body={"avatar_id": avatar, "text": "Hi."},
                             media_type="application/json")
        self.jobs += [r.json()["id"] for r in got if r.status_code == 202]

    def get_render(self, data):  # type: ignore[no-untyped-def]
        self._call(data, "GET /v1/renders/{id}", {"id": data.draw(st.sampled_from(self.jobs))})

    def render_output(self, data):  # type: ignore[no-untyped-def]
        """The MP4 once something is written (polled while the job runs)."""
        label, job = "GET /v1/renders/{id}/output", data.draw(st.sampled_from(self.jobs))
        if data.draw(st.booleans(), label="generated"):
            _send(_fuzzed(data, label), label, {"id": job})
        until = time.monotonic() + 20.0
        while _send(_case(label, path_parameters={"id": job}), label).status_code != 200:
            state = _send(_case("GET /v1/renders/{id}", path_parameters={"id": job}),
                          "GET /v1/renders/{id}")
            if state.status_code != 200 or state.json()["state"] in ("failed", "cancelled") \
                    or time.monotonic() > until:
                break
            time.sleep(0.25)

    def delete_render(self, data):  # type: ignore[no-untyped-def]
        job = data.draw(st.sampled_from(self.jobs))
        self.jobs.remove(job)
        self._call(data, "DELETE /v1/renders/{id}", {"id": job})

    def teardown(self) -> None:
        """Delete what is left (valid requests, checked and counted like the others): the next
        example starts with the server's capacity free."""
        for s in self.sessions:
            _send(_case("DELETE /v1/sessions/{id}", path_parameters={"id": s["session_id"]}),
                  "DELETE /v1/sessions/{id}")
        for job in self.jobs:
            _send(_case("DELETE /v1/renders/{id}", path_parameters={"id": job}),
                  "DELETE /v1/renders/{id}")


async def _converse(url: str, pcm: bytes, control: str) -> None:
    """Send a speech packet, a control message and a marker the server answers with an error
    event; every event before it must be a known one, and the session must not end."""
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url) as ws:
            await ws.send_bytes(pcm)
            await ws.send_str(json.dumps({"type": control}))
            await ws.send_str('{"type": "marker"}')
            while True:
                msg = await ws.receive(timeout=30)
                assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data)
                event = json.loads(msg.data)
                assert event.get("type") in EVENTS and event["type"] != "session_ended", event
                if event["type"] == "error" and "control messages" in event["error"]:
                    break


def _wait_until_no_session_is_live(server: InProcessServer, timeout_s: float = 45.0) -> None:
    """A run starts with the server's capacity free. A session deleted at some moments still
    counts as live until its idle timeout (30 s; seen after the long run, not yet explained):
    without this wait the next run met a full server (503) on every create."""
    until = time.monotonic() + timeout_s
    while (live := plain(AUTH, "GET", server.url + "/v1/server").json()["live_sessions"]) \
            and time.monotonic() < until:
        time.sleep(0.5)
    assert not live, f"{live} sessions still live {timeout_s:.0f} s after the last run"


def _run(server: InProcessServer, budget_s: float, examples: int = EXAMPLES) -> Run:
    """Run the machine against `server` for at most `budget_s`; returns what it saw."""
    global RUN
    _wait_until_no_session_is_live(server)
    RUN = Run(server, time.monotonic() + budget_s)
    try:
        run_state_machine_as_test(ServerMachine, settings=settings(
            max_examples=examples, stateful_step_count=STEPS, deadline=None, derandomize=True,
            database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
        return RUN
    finally:
        print(RUN.table())  # shown with the test's output (pytest -rA, -s, or on failure)


def _complete(run: Run) -> None:
    """The run did all it planned, reached every operation's success, and no 5xx."""
    assert not run.spent, (f"the fuzz budget ran out after {run.steps} steps; never reached "
                           f"2xx: {run.missing()}\n{run.table()}")
    assert not run.missing(), f"never reached 2xx: {run.missing()}\n{run.table()}"
    # 5xx: only the documented 503 of a full server (checked per answer too: Retry-After)
    assert not [(op, code) for op, c in run.statuses.items() for code in c if code >= 500
                and (op, code) != ("POST /v1/sessions", 503)], run.table()


def test_every_operation_succeeds_and_nothing_fails_on_the_server(server):  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    run = _run(server, BUDGET_S)
    _complete(run)
    assert not server.errors.records, server.errors.records[:3]
    print(f"{run.steps} steps in {time.monotonic() - t0:.1f} s")


def test_a_run_out_of_time_fails(server):  # type: ignore[no-untyped-def]
    run = _run(server, budget_s=0.0)
    assert run.spent and run.steps == 0
    with pytest.raises(AssertionError, match="budget ran out"):
        _complete(run)


@pytest.mark.parametrize("label", ["POST /v1/sessions/{id}/say", "GET /v1/renders/{id}/output"])
def test_an_error_in_a_handler_fails_the_fuzz(server, label):  # type: ignore[no-untyped-def]
    """The proof that the fuzz reaches each handler's success path: a RuntimeError raised where
    it would answer 2xx (a 500 from the server) fails the run."""
    from schemathesis.core.failures import FailureGroup, ServerError

    INJECT.add(label)
    try:
        with pytest.raises(FailureGroup) as failed:
            _run(server, BUDGET_S)
    finally:
        INJECT.clear()
        server.errors.records.clear()  # the injected failures are logged, as they should be
    assert any(isinstance(e, ServerError) for e in failed.value.exceptions), failed.value
    assert RUN is not None and RUN.statuses[label][500] == 1, RUN.table()
