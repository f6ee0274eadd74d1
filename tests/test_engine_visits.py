"""What the engine's host reads after each visit (a small summary of the visit, not the whole state): every
request's tokens reach its stream at the visit that emitted them, the stream is its output, cut at its own
stop ids, and its acceptance counts are the ones `generate` counts for its prompt alone."""

import asyncio
import dataclasses
import gc
import math
import re
import threading

import pytest
from support.engine import SPECS, drafter_for, load_config, random_requests, serve_arriving
from support.models import EOS, target_and_drafts

from specjax.decoding import generate
from specjax.engine import Engine, GcPauses, Request, VisitPacing, freeze_heap
from specjax.serve import EngineRunner, EventReader


def with_stop_ids_inside(target, requests: list[Request]) -> list[Request]:
    """The requests, every third with a stop id its greedy output emits (the first token for one of them)."""
    sequences = generate(target, [list(r.prompt) for r in requests], max_new_tokens=[r.max_tokens for r in requests],
                         eos_token_ids=(EOS,)).sequences()
    changed = []
    for i, (request, tokens) in enumerate(zip(requests, sequences)):
        stop = () if i % 3 or len(tokens) < 2 else (tokens[0 if i == 0 else len(tokens) // 2],)
        changed.append(dataclasses.replace(request, stop_token_ids=stop))
    return changed


def without_nan(metrics: dict) -> dict:
    """The metrics with NaN (a request that ran no speculative step) as None, so that == compares them."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}


@pytest.mark.loop
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_visit_streams_its_tokens_and_the_counts_are_those_of_generate(async_scheduling):
    """With async scheduling too (EngineConfig.async_scheduling: a visit's tokens are read while the next runs)."""
    target, _ = target_and_drafts()
    spec = SPECS["eagle"]
    streamed = {}
    config = load_config(spec, async_scheduling=async_scheduling)  # the load tests' engine: its programs
    engine = Engine(target, config, drafter=drafter_for("eagle"),
                    on_tokens=lambda new: [streamed.setdefault(i, []).append(list(ids)) for i, ids in new.items()])
    requests = with_stop_ids_inside(target, random_requests(16, seed=1))
    outputs = serve_arriving(engine, requests)
    most = config.steps_per_visit * (spec.num_speculative_tokens + 1)  # what one visit can emit for a request
    for request in requests:
        output, chunks = outputs[request.request_id], streamed[request.request_id]
        assert [t for chunk in chunks for t in chunk] == list(output.tokens), request.request_id
        assert chunks[0] == [output.tokens[0]]  # the prefill's token alone, before the visit's steps
        assert all(0 < len(chunk) <= most for chunk in chunks[1:])  # each visit streamed what it emitted
        assert len(output.token_times) == len(output.tokens)
    for request in requests:  # a stop id of its own ends the request there, the first token's included
        if request.stop_token_ids:
            output = outputs[request.request_id]
            assert output.tokens.index(request.stop_token_ids[0]) == len(output.tokens) - 1, request.request_id
            assert output.finish_reason == "stop"
    # Requests without a stop id of their own: the counts of generate's speculative loop for them.
    plain = [r for r in requests if not r.stop_token_ids]
    result = generate(target, [list(r.prompt) for r in plain], max_new_tokens=[r.max_tokens for r in plain],
                      eos_token_ids=(EOS,), spec=spec, drafter=drafter_for("eagle"))
    for row, request in enumerate(plain):
        want = result.metrics.per_request()[row] | result.metrics.per_step(row)
        assert without_nan(outputs[request.request_id].metrics) == without_nan(want), request.request_id


def admissions(runner: EngineRunner) -> dict:
    """request id -> the engine's visit count when the runner's thread added it (filled as the runner runs)."""
    admitted_at, add = {}, runner.engine.add_request

    def recording(request):
        admitted_at[request.request_id] = runner.engine.visits
        add(request)

    runner.engine.add_request = recording
    return admitted_at


def serve_clients(runner: EngineRunner, clients) -> None:
    """Runs the clients' coroutine on an event loop while the runner's thread serves them; stops the thread."""
    runner.start()
    try:
        asyncio.run(clients)
    finally:
        runner.stop()


@pytest.mark.loop
@pytest.mark.parametrize("admit_wait_s, together", [(2.0, True), (0.0, False)], ids=["gathering", "not_gathering"])
def test_the_servers_engine_thread_admits_a_request_arriving_just_after_another_into_the_same_visit(admit_wait_s,
                                                                                                  together):
    """A visit admits nothing while it runs, so a request arriving 100 ms after another at an idle engine waits a
    visit or more, unless the server's thread first gathers arrivals (serve/_runner.py; a gap of 0.5 s here): the
    HTTP clients' refills of issue 38. Without gathering (the control) the second lands in a later visit."""
    runner = EngineRunner(target_and_drafts()[0], load_config(None), admit_wait_s=admit_wait_s, admit_gap_s=0.5)
    admitted_at = admissions(runner)

    async def two_requests():
        queues = [runner.submit(Request.make("first", [1, 2, 3], 24))]
        await asyncio.sleep(0.1)
        queues.append(runner.submit(Request.make("second", [4, 5, 6], 24)))
        for queue in queues:
            while (await queue.get())[0] != "done":
                pass

    serve_clients(runner, two_requests())
    assert (admitted_at["first"] == admitted_at["second"]) == together, admitted_at


@pytest.mark.loop
@pytest.mark.parametrize("admit_wait_s, together", [(2.0, True), (0.0, False)], ids=["gathering", "not_gathering"])
def test_the_servers_engine_thread_waits_for_the_replacement_of_a_request_that_ended(admit_wait_s, together):
    """A closed-loop client sends its next request 100 ms after one ends, while another request still runs: the
    thread holds the next visit until the replacement is in (admit_share large here, so admit_wait_s bounds it)
    and admits it at the visit right after the end. Without gathering (the control) a visit starts at once and
    the replacement waits for the next."""
    runner = EngineRunner(target_and_drafts()[0], load_config(None), admit_wait_s=admit_wait_s, admit_share=1e3)
    admitted_at = admissions(runner)
    ended_at = {}
    serve_clients(runner, replaced_after_its_end(runner, ended_at))
    assert (admitted_at["replacement"] == ended_at["short"]) == together, (admitted_at, ended_at)


async def replaced_after_its_end(runner: EngineRunner, ended_at: dict):
    """A closed-loop client: 'short' (2 tokens) beside 'long' (40); 100 ms after short ends, its 'replacement'.
    ended_at['short']: the engine's visit count when short's end reached the client."""
    long = runner.submit(Request.make("long", [4, 5, 6], 40))
    short = runner.submit(Request.make("short", [1, 2, 3], 2))
    while (await short.get())[0] != "done":
        pass
    ended_at["short"] = runner.engine.visits
    await asyncio.sleep(0.1)
    replacement = runner.submit(Request.make("replacement", [7, 8, 9], 4))
    for queue in (long, replacement):
        while (await queue.get())[0] != "done":
            pass


@pytest.mark.loop
@pytest.mark.parametrize("admit_wait_s, together", [(2.0, True), (0.0, False)], ids=["gathering", "not_gathering"])
def test_the_servers_engine_thread_waits_for_a_replacement_beyond_what_arrived_during_the_visit(admit_wait_s,
                                                                                               together):
    """A request arrives while the visit that ends another runs; the ended one's replacement comes 100 ms after
    the end. The first is not the replacement: the thread still waits for it and admits both in one visit
    (counted as the replacement, it started the visit at once and the replacement waited beside an empty slot).
    Without gathering (the control) they land in different visits."""
    runner = EngineRunner(target_and_drafts()[0], load_config(None), admit_wait_s=admit_wait_s, admit_share=1e3)
    admitted_at = admissions(runner)
    step = runner.engine.step

    def step_with_an_arrival(**kwargs):
        outputs = step(**kwargs)
        if any(output.request_id == "short" for output in outputs):  # arrives while this visit runs
            runner.submit_to(Request.make("during", [5, 6, 7], 4), lambda event: None)
        return outputs

    runner.engine.step = step_with_an_arrival
    serve_clients(runner, replaced_after_its_end(runner, {}))
    assert (admitted_at["replacement"] == admitted_at["during"]) == together, admitted_at


@pytest.mark.loop
@pytest.mark.xdist_group("load-eagle")  # the load tests' EAGLE engine: its programs
def test_the_servers_engine_thread_logs_what_the_engine_did(caplog):
    """The periodic stats line (vLLM's): one at least for a short burst of requests (going idle ends the last
    interval), with the counters behind it: the tokens the streams received, slots stepped; the speculative
    line's acceptance, the ended requests' counts summed; and a line of the garbage collector's time, here a full
    collection in the engine's thread as it hands tokens over in its second visit or later (inside engine.step,
    after the step whose end began the first interval), of 300,000 objects made for it (frozen heap or not)."""
    runner = EngineRunner(target_and_drafts()[0], load_config(SPECS["eagle"]), drafter=drafter_for("eagle"),
                          log_stats_interval_s=1e-3)
    received, ended, ballast = [], [], [[] for _ in range(300_000)]

    def send(event):  # the engine's thread calls it with each of a request's events
        if event[0] == "tokens":
            received.extend(event[1])
            if ballast and runner.engine.stats()["visits"] >= 2:
                gc.collect()
                ballast.clear()
        else:
            ended.append(event)

    async def requests():
        for i in range(3):
            runner.submit_to(Request.make(f"r{i}", [1 + i, 2, 3], 24), send)
        while len(ended) < 3:
            await asyncio.sleep(0.01)

    with caplog.at_level("INFO", logger="specjax.serve"):
        serve_clients(runner, requests())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")]
    assert lines and "steps/visit" in lines[-1], lines
    # The time shares split the interval: device, the rest of engine.step, gathering, handing ends over, the
    # runner's own; the device's share says the part of it spent on the prefills (three requests, three prefills).
    device, prefills = (float(x) for x in re.search(r"; device (\d+)% \(prefills (\d+)%\)", lines[-1]).groups())
    shares = [float(x) for x in re.findall(r"(-?\d+)%", lines[-1].split("; device")[1].split(")", 1)[1])]
    assert len(shares) == 4 and min(shares) >= 0 and 95 <= device + sum(shares) <= 105, lines[-1]
    assert 0 <= prefills <= device, lines[-1]
    assert runner.ends_s > 0
    assert runner.tokens_sent == len(received) > 0
    stats = runner.engine.stats()
    assert stats["steps"] > 0 and 0 < stats["busy_slot_steps"] <= stats["slot_steps"]
    spec_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speculative, ")]
    counts = runner.spec_counts
    assert counts["spec_steps"] > 0 and counts["spec_drafted"] == 3 * counts["spec_steps"]  # K 3 at every step
    assert spec_lines and f"{counts['spec_drafted'] / counts['spec_steps']:.1f} drafts verified" in spec_lines[-1]
    assert not ballast and runner.gc.seconds > 0  # collected in the second visit or later
    assert any(r.getMessage().startswith("garbage collection: ") for r in caplog.records)


def test_a_frozen_heap_is_out_of_the_collectors_reach_and_its_pauses_are_counted():
    """freeze_heap (after a server's warm-up): what lived then is no longer tracked by the collector, so no later
    collection walks it; GcPauses times collections from its making to its close, and take_longest starts over."""
    survivor = [[]]  # a container: one the collector tracks
    assert any(o is survivor for o in gc.get_objects())
    try:
        frozen, _ = freeze_heap()
        # Frozen objects may be freed since (another thread's, say): the count only falls.
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(o is survivor for o in gc.get_objects())
        pauses = GcPauses()
        gc.collect()
        assert pauses.seconds > 0 and pauses.take_longest() > 0 and pauses.longest == 0
        pauses.close()
        seconds = pauses.seconds
        gc.collect()
        assert pauses.seconds == seconds  # closed: no longer counting
    finally:
        gc.unfreeze()
    assert any(o is survivor for o in gc.get_objects())


@pytest.mark.loop
def test_the_servers_engine_thread_hands_a_visits_events_to_the_event_loop_at_once():
    """Every call_soon_threadsafe from the engine's thread waits for the GIL that a busy event loop holds, so a
    visit's events (every request's tokens, then the ends) go over together: at most three hand-overs a visit
    (the admitted requests' first tokens, the visit's tokens, its ends), however many requests it stepped."""
    runner = EngineRunner(target_and_drafts()[0], load_config(None), admit_wait_s=2.0, admit_gap_s=0.5)
    events, handovers = [], []

    async def four_requests():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(callback, *args):
            if threading.current_thread() is not threading.main_thread():
                handovers.append(len(args[0]) if args else 1)
            return real(callback, *args)

        loop.call_soon_threadsafe = counted
        queues = [runner.submit(Request.make(f"r{i}", [1 + i, 2, 3], 20)) for i in range(4)]
        for queue in queues:
            while (event := await queue.get())[0] != "done":
                events.append(event)
            events.append(event)

    serve_clients(runner, four_requests())
    assert sum(handovers) == len(events)  # every event went over in one of them
    assert len(handovers) <= 3 * runner.engine.visits, (handovers, runner.engine.visits)
    assert len(handovers) < len(events)
    assert max(handovers) == 4  # the four requests' events of one visit together


@pytest.mark.loop
@pytest.mark.parametrize("end_on_finish", [True, False])
def test_a_visit_asked_to_end_when_a_row_ends_ends_there_though_nothing_waits(end_on_finish):
    """Engine.step(end_on_finish=True), the server's: the visit ends at the step where the two-token request
    ends, and the other row goes on in the next; without it (the control) the visit runs its steps_per_visit."""
    engine = Engine(target_and_drafts()[0], load_config(None))
    engine.add_request(Request.make("short", [1, 2, 3], 2))
    engine.add_request(Request.make("long", [4, 5, 6], 40))
    ended = engine.step(end_on_finish=end_on_finish)
    assert [o.request_id for o in ended] == ["short"]
    assert engine.steps_run == (1 if end_on_finish else engine.config.steps_per_visit)
    assert [r.request.request_id for r in engine.running.values()] == ["long"]


@pytest.mark.loop
@pytest.mark.parametrize("visit_ends", [1, 2])
def test_a_visit_with_requests_waiting_stops_once_visit_ends_rows_ended(visit_ends):
    """EngineConfig.visit_ends: with every slot taken and two requests waiting, the visit stops at the step where
    its visit_ends-th row ends (budgets 2 and 3 end at steps 1 and 2), not at the first end; the slots freed go to
    the waiting requests at the next step. (The programs of the test above: 4 slots, no speculation.)"""
    engine = Engine(target_and_drafts()[0], load_config(None, visit_ends=visit_ends))
    for i, budget in enumerate((2, 3, 9, 9, 9, 9)):
        engine.add_request(Request.make(f"r{i}", [4 + i, 5, 6], budget))
    ended = engine.step()
    assert engine.steps_run == visit_ends
    assert [o.request_id for o in ended] == ["r0", "r1"][:visit_ends]
    assert (engine.stats()["paced_visits"], engine.stats()["paced_ends"]) == (1, visit_ends)
    assert len(engine.waiting) == 2
    engine.step()
    assert len(engine.waiting) == 2 - visit_ends


def test_visit_pacing_waits_for_more_ends_the_more_a_visit_costs_the_host():
    """VisitPacing: k = sqrt(2 busy h e / s) from its running means; 1 before any visit and with no host time."""
    pacing = VisitPacing(decay=0.5)
    assert pacing.ends_to_stop(256) == 1
    pacing.record(host_s=0.014, device_s=0.1, steps=2, ends=16)  # 50 ms steps, 8 ends a step
    assert pacing.ends_to_stop(256) == round(math.sqrt(2 * 256 * 0.014 * 8 / 0.05)) == 34
    assert pacing.ends_to_stop(1) == 1  # at most the rows busy
    pacing.record(host_s=0.0, device_s=0.05, steps=1, ends=8)  # the means move halfway
    assert pacing.host_s == pytest.approx(0.007) and pacing.ends_per_step == pytest.approx(8.0)
    assert pacing.ends_to_stop(256) == round(math.sqrt(2 * 256 * 0.007 * 8 / 0.05)) == 24
    pacing.record(host_s=0.0, device_s=0.0, steps=0, ends=3)  # a visit of no steps says nothing
    assert pacing.ends_to_stop(256) == 24
    assert VisitPacing(host_s=0.0, step_s=0.05, ends_per_step=8.0).ends_to_stop(256) == 1


def test_a_reader_behind_the_engine_reads_the_tokens_that_piled_up_as_one_event():
    """EventReader: tokens events queued behind each other come out merged, up to the next event of another
    kind, which comes out as it is; a reader that keeps up (the control: each event read as it is queued) gets
    each as it was sent."""
    events = [("tokens", [1]), ("tokens", [2, 3]), ("tokens", [4]), ("failed", "why"), ("tokens", [5]),
              ("done", "output")]

    async def behind() -> list[tuple]:
        queue = asyncio.Queue()
        reader = EventReader(queue)
        for event in events:
            queue.put_nowait(event)
        return [await reader.next() for _ in range(4)]

    async def keeping_up() -> list[tuple]:
        queue, got = asyncio.Queue(), []
        reader = EventReader(queue)
        for event in events:
            queue.put_nowait(event)
            got.append(await reader.next())
        return got

    assert asyncio.run(behind()) == [("tokens", [1, 2, 3, 4]), ("failed", "why"), ("tokens", [5]), ("done", "output")]
    assert asyncio.run(keeping_up()) == events


@pytest.mark.loop
def test_a_warm_up_without_the_sampled_programs_leaves_them_to_the_first_sampled_request(caplog):
    """EngineRunner.warm_up(sampled=False) (--no-warmup-sampled): every stage greedy, and a sampled request
    afterwards is still served, its programs compiled at its arrival (the control, sampled=True, warms both)."""
    def stages(sampled: bool) -> list[str]:
        runner = EngineRunner(target_and_drafts()[0], load_config(None))
        caplog.clear()
        with caplog.at_level("INFO", logger="specjax.serve"):
            runner.warm_up([1, 2, 3], sampled=sampled)
        return runner, [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up ")]

    runner, greedy_only = stages(False)
    assert greedy_only and all("greedy" in line for line in greedy_only), greedy_only
    assert any("sampled" in line for line in stages(True)[1])

    async def one_sampled():
        queue = runner.submit(Request.make("sampled", [1, 2, 3], 8, temperature=1.0, seed=3))
        while (event := await queue.get())[0] != "done":
            pass
        return event[1]

    runner.start()
    try:
        output = asyncio.run(one_sampled())
    finally:
        runner.stop()
    assert output.finish_reason in ("length", "stop") and len(output.tokens) >= 1


@pytest.mark.loop
@pytest.mark.parametrize("end_on_finish", [True, False])
def test_the_servers_engine_thread_ends_a_visit_when_a_request_ends_when_asked(end_on_finish):
    """EngineRunner(end_on_finish=True) (--end-visits-on-finish): the two-token request ends the first visit
    after one step though nothing waits; without it (the default, the control) that visit runs its 3 steps."""
    runner = EngineRunner(target_and_drafts()[0], load_config(None), admit_wait_s=2.0, admit_gap_s=0.5,
                          end_on_finish=end_on_finish)
    ended_after, step = {}, runner.engine.step

    def recording(**kwargs):  # on the engine's thread: the steps run when each request's end was read
        outputs = step(**kwargs)
        ended_after.update({output.request_id: runner.engine.steps_run for output in outputs})
        return outputs

    runner.engine.step = recording

    async def two_requests():
        queues = [runner.submit(Request.make("short", [1, 2, 3], 2)),
                  runner.submit(Request.make("long", [4, 5, 6], 40))]
        for queue in queues:
            while (await queue.get())[0] != "done":
                pass

    serve_clients(runner, two_requests())
    assert ended_after["short"] == (1 if end_on_finish else runner.engine.config.steps_per_visit), ended_after
