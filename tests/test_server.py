"""`specjax serve` as a real process on a free port, driven by the `openai` client and httpx: completions,
chat and streaming; vLLM's per-request metrics object and its invariants; /metrics read by the Prometheus
parser; bad requests refused with a 4xx naming the field while the server goes on; a client that goes
away mid-stream frees its slot; SIGTERM lets requests in flight finish (or end with a clear error) and
exits 0. Two servers on the bundled models: EAGLE with 4 slots and detailed metrics, n-gram with 1 slot."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import openai
import pytest
from support.checkpoints import REPO
from prometheus_client.parser import text_string_to_metric_families

from specjax import cli
from specjax.serve import FLAGS, Detokenizer, ServeConfig, load_serve_config, spec_decode_metrics

# One worker runs the whole file under `pytest -n 2 --dist loadgroup` (make test): its tests share the servers.
pytestmark = pytest.mark.xdist_group("serve")

MODEL = "default:target"
SUMMARY_FIELDS = {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
                  "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens"}
DETAILED_FIELDS = SUMMARY_FIELDS | {"per_step_accepted", "per_step_drafted"}
LONG_PROMPT = "def fibonacci(n):"  # greedy, the bundled target writes 900 tokens on it without an EOS
STARTUP_S = 240  # loading and compiling on two busy CPU cores


class Server:
    """A `specjax serve` process; its output goes to a log file the tests read."""

    def __init__(self, log: Path, *args: str, new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as out:  # new_session: a process group of its own, for a terminal's Ctrl-C (killpg)
            self.process = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--port", str(self.port),
                                             *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=new_session)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited ({self.process.returncode}):\n{log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            pytest.fail(f"the server was not ready in {STARTUP_S} s:\n{log.read_text()}")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def post(self, path: str, body) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, headers={"Content-Type": "application/json"},
                          timeout=120)

    def metrics(self) -> dict[tuple, float]:
        """/metrics as {(sample name, sorted labels): value}, through the Prometheus parser."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=120)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specjax import default_models

    return AutoTokenizer.from_pretrained(default_models.tokenizer_folder(MODEL))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    running = Server(folder / "eagle.log", "--method", "eagle", "--max-num-seqs", "4",
                     "--max-model-len", "256", "--per-request-spec-decode-metrics", "detailed",
                     "--profile-dir", str(folder / "traces"))
    yield running
    assert running.stop() == 0, running.log.read_text()


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """One slot, so a request waits for the one before it; a short drain, so SIGTERM's timeout shows."""
    running = Server(tmp_path_factory.mktemp("serve") / "ngram.log", "--method", "ngram", "--max-num-seqs", "1",
                     "--max-model-len", "1024", "--per-request-spec-decode-metrics", "summary",
                     "--shutdown-timeout", "3")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory):
    """The engine in a child process (--engine-process): one slot, so that a freed slot shows."""
    folder = tmp_path_factory.mktemp("serve")
    running = Server(folder / "process.log", "--method", "eagle", "--max-num-seqs", "1", "--max-model-len", "1024",
                     "--per-request-spec-decode-metrics", "detailed", "--engine-process",
                     "--profile-dir", str(folder / "traces"), new_session=True)
    yield running
    assert running.stop() == 0, running.log.read_text()


def check_metrics(metrics: dict, fields: set[str]) -> None:
    """vLLM's fields and the invariants of its test, and the per-step arrays summing to the summary."""
    assert set(metrics) == fields
    steps, accepted, drafted = metrics["num_spec_steps"], metrics["num_accepted_draft_tokens"], metrics["num_draft_tokens"]
    histogram = metrics["acceptance_histogram"]
    assert steps > 0 and steps == sum(histogram)
    assert metrics["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert metrics["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert len(histogram) == metrics["num_spec_tokens"] + 1 and drafted == steps * metrics["num_spec_tokens"]
    assert accepted == sum(n * count for n, count in enumerate(histogram))
    if "per_step_accepted" in fields:
        per_step, per_drafted = metrics["per_step_accepted"], metrics["per_step_drafted"]
        assert len(per_step) == len(per_drafted) == steps
        assert sum(per_step) == accepted and sum(per_drafted) == drafted
        assert [per_step.count(n) for n in range(len(histogram))] == histogram


@pytest.mark.e2e
def test_completion_with_the_openai_client(server, tokenizer):
    completion = server.client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=24,
                                                  temperature=0)
    assert completion.id.startswith("cmpl-")
    choice = completion.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    tokens = completion.usage.completion_tokens  # all 24 unless the model ended the text
    assert (tokens == 24) if choice.finish_reason == "length" else (1 <= tokens < 24)
    assert completion.usage.prompt_tokens == len(tokenizer.encode("def fibonacci(n):", add_special_tokens=False)) + 1
    metrics = completion.model_extra["metrics"]["speculative_decoding"]
    check_metrics(metrics, DETAILED_FIELDS)
    assert metrics["num_spec_tokens"] == 4
    # Token ids as the prompt (the BOS, then the text's) give the same greedy text.
    ids = [tokenizer.bos_token_id, *tokenizer.encode("def fibonacci(n):", add_special_tokens=False)]
    by_ids = server.post("/v1/completions", {"prompt": ids, "max_tokens": 24, "temperature": 0}).json()
    assert by_ids["usage"]["prompt_tokens"] == completion.usage.prompt_tokens
    assert by_ids["choices"][0]["text"] == choice.text


@pytest.mark.e2e
def test_chat_with_the_openai_client(server):
    chat = server.client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}])
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    check_metrics(chat.model_extra["metrics"]["speculative_decoding"], DETAILED_FIELDS)
    # Without a chat template the prompt is the plain one: a line per message, then "assistant:".
    plain = server.post("/v1/completions", {"prompt": "system: You write Python.\nuser: import os\nassistant:",
                                            "max_tokens": 16, "temperature": 0}).json()
    assert plain["choices"][0]["text"] == chat.choices[0].message.content


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_gives_the_whole_text_and_the_metrics_in_the_usage_chunk(server, kind):
    if kind == "chat":
        create, args = server.client.chat.completions.create, {"messages": [{"role": "user", "content": "class A:"}]}
    else:
        create, args = server.client.completions.create, {"prompt": "class A:"}
    whole = create(model=MODEL, max_tokens=120, temperature=0, **args)
    chunks = list(create(model=MODEL, max_tokens=120, temperature=0, stream=True,
                         stream_options={"include_usage": True}, **args))
    # More tokens than one engine visit makes (16 steps of at most K + 1 = 5) come in several chunks.
    assert whole.usage.completion_tokens > 80 and len(chunks) > 4
    *body, last = chunks
    if kind == "chat":
        text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text == whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in body)
        assert text == whole.choices[0].text
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert not last.choices and last.usage.completion_tokens == whole.usage.completion_tokens
    assert all("metrics" not in (c.model_extra or {}) for c in body)  # once, in the usage chunk
    metrics = last.model_extra["metrics"]["speculative_decoding"]
    check_metrics(metrics, DETAILED_FIELDS)
    assert metrics == whole.model_extra["metrics"]["speculative_decoding"]  # greedy: the same steps
    # Without include_usage: no usage chunk, so no metrics.
    plain = list(create(model=MODEL, max_tokens=8, temperature=0, stream=True, **args))
    assert all(c.choices and "metrics" not in (c.model_extra or {}) for c in plain)


@pytest.mark.e2e
def test_a_request_is_independent_of_the_ones_beside_it(server):
    """Greedy text served alone equals the text served among sampled requests (4 slots, 6 requests)."""
    alone = server.client.completions.create(model=MODEL, prompt="import sys\n", max_tokens=32, temperature=0)
    results = {}

    def ask(i):
        sampled = {"temperature": 0.8, "seed": i} if i else {"temperature": 0}
        results[i] = server.client.completions.create(model=MODEL, prompt="import sys\n" if i == 0 else f"x = {i}",
                                                      max_tokens=32, **sampled)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(6))
    assert results[0].choices[0].text == alone.choices[0].text
    for result in results.values():
        check_metrics(result.model_extra["metrics"]["speculative_decoding"], DETAILED_FIELDS)


@pytest.mark.e2e
def test_metrics_endpoint_counts_with_vllm_names(server):
    before = server.metrics()
    completion = server.client.completions.create(model=MODEL, prompt="for i in range(", max_tokens=20, temperature=0)
    after = server.metrics()
    spec = completion.model_extra["metrics"]["speculative_decoding"]
    label = (("model_name", MODEL),)

    def grew(name, labels=label):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("vllm:spec_decode_num_drafts_total") == spec["num_spec_steps"]
    assert grew("vllm:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == spec["num_accepted_draft_tokens"]
    histogram = spec["acceptance_histogram"]
    for position in range(spec["num_spec_tokens"]):
        labels = (("model_name", MODEL), ("position", str(position)))
        assert grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", labels) == sum(histogram[position + 1:])
    assert grew("vllm:generation_tokens_total") == completion.usage.completion_tokens
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:request_success_total", (("finished_reason", completion.choices[0].finish_reason),
                                               ("model_name", MODEL))) == 1


@pytest.mark.e2e
@pytest.mark.parametrize("body, status, param, says", [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ({"prompt": "x", "n": 2}, 400, "n", "n = 2 is invalid"),
    ({"prompt": "x", "max_tokens": 300}, 400, "max_tokens", "allowed at most 249 new tokens"),
    ('{"prompt": "x", ', 400, None, "malformed JSON"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature = -0.5 is invalid"),
    ({"prompt": "x", "stop": ["\n"]}, 400, "stop", "stop is not supported"),
    ({"prompt": [1, 99999]}, 400, "prompt", "token id 99999"),
    ({"max_tokens": 4}, 400, "prompt", "prompt is missing"),
])
def test_a_bad_request_gets_a_4xx_naming_the_field_and_the_server_goes_on(server, body, status, param, says):
    response = server.post("/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    good = server.post("/v1/completions", {"prompt": "x = 1", "max_tokens": 4, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.e2e
def test_bench_serves_client_split_over_processes_serves_every_request_once(server):
    """`bench-serve --url --client-processes 2`: the two processes' requests together are the point's, each
    streamed whole (its usage's tokens), and the speculative metrics came back with them; the processes sent
    their first requests together (a barrier after their start-up, which takes seconds each). Each request asks
    for its own budget (--random-range-ratio), the same from either split."""
    from specjax.bench_serve import http_point

    prompts = [[5, 9, 2, 7], [4, 11, 3], [8, 1, 6, 2, 9]]
    one = http_point(server.url, prompts, num_requests=5, new_tokens=6, concurrency=3, rate=None, burstiness=1.0,
                     seed=0, processes=1, range_ratio=0.5)
    two = http_point(server.url, prompts, num_requests=5, new_tokens=6, concurrency=3, rate=None, burstiness=1.0,
                     seed=0, processes=2, range_ratio=0.5)
    assert one["requests"] == two["requests"] == 5
    assert one["output_tokens"] == two["output_tokens"] > 0  # greedy: the same requests, the same tokens
    assert two["mean_acceptance_length"] >= 1
    assert one["client_start_spread_ms"] == 0 and two["client_start_spread_ms"] < 500, two


@pytest.mark.e2e
def test_models_health_and_one_access_log_line_per_request(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    # The warm-up logged each of its stages, in order, before serving.
    stages = re.findall(r"warm-up (\d+)/(\d+): ", server.log.read_text())
    assert stages and [int(done) for done, _ in stages] == list(range(1, int(stages[0][1]) + 1)), stages
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    completion = server.client.completions.create(model=MODEL, prompt="x = [", max_tokens=8, temperature=0)
    deadline = time.monotonic() + 10
    while completion.id not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in server.log.read_text().splitlines() if completion.id in line]
    assert len(lines) == 1, lines
    assert " 200 /v1/completions " in lines[0]
    for field in ("prompt_tokens=", f"completion_tokens={completion.usage.completion_tokens}", "ttft=", "total=",
                  "mean_acceptance_length="):
        assert field in lines[0]


def test_start_and_stop_profile_trace_requests_and_say_what_the_trace_holds(server, one_slot):
    assert httpx.post(f"{one_slot.url}/start_profile").status_code == 404  # no --profile-dir
    assert httpx.post(f"{server.url}/stop_profile").status_code == 409  # none started
    assert httpx.post(f"{server.url}/start_profile").status_code == 200
    again = httpx.post(f"{server.url}/start_profile")
    assert again.status_code == 409 and "POST /stop_profile first" in again.json()["error"]["message"]
    completion = server.client.completions.create(model=MODEL, prompt="x = [", max_tokens=8, temperature=0)
    assert completion.usage.completion_tokens >= 1  # served while tracing
    stopped = httpx.post(f"{server.url}/stop_profile", timeout=60)
    assert stopped.status_code == 200, stopped.text
    summary = stopped.json()
    assert Path(summary["trace"]).is_file() and Path(summary["trace"]).name == "perfetto_trace.json.gz"
    # The CPU has no device kernels: the answer says so; on a GPU it has the busy share (specjax.profiling).
    assert "no device kernels" in summary["device"] if jax.default_backend() == "cpu" else 0 < summary["busy_share"] <= 1


@pytest.mark.e2e
def test_the_engine_in_its_own_process_serves_as_the_thread_does(engine_process, server):
    """Completions, a stream, metrics, a disconnect that frees the one slot, and a profile, through the pipe."""
    prompt = "def fibonacci(n):"
    ask = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    remote, local = engine_process.client.completions.create(**ask), server.client.completions.create(**ask)
    assert remote.choices[0].text == local.choices[0].text and remote.usage == local.usage
    check_metrics(remote.metrics["speculative_decoding"], DETAILED_FIELDS)
    chunks = list(engine_process.client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == local.choices[0].text
    assert chunks[-1].usage.completion_tokens == 24
    assert engine_process.metrics()[("vllm:request_success_total",
                                     (("finished_reason", "length"), ("model_name", MODEL)))] == 2
    # A disconnect mid-stream aborts in the child: the one slot serves the next request at once.
    with httpx.stream("POST", f"{engine_process.url}/v1/completions", timeout=60,
                      json={"prompt": LONG_PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    started = time.monotonic()
    assert engine_process.client.completions.create(**ask).choices[0].text == local.choices[0].text
    assert time.monotonic() - started < 30
    # The profiler runs where the engine is: the child's trace.
    assert httpx.post(f"{engine_process.url}/start_profile").status_code == 200
    engine_process.client.completions.create(**ask)
    summary = httpx.post(f"{engine_process.url}/stop_profile", timeout=60).json()
    assert Path(summary["trace"]).is_file()
    log = engine_process.log.read_text()
    assert "the engine runs in process" in log
    assert log.count("froze ") == 2, log  # after warm-up, the engine's heap and the HTTP side's (engine/_heap.py)
    # A terminal's Ctrl-C reaches the whole process group: the engine process ignores it and the server drains
    # through it, so the request in flight finishes and the server exits 0.
    with httpx.stream("POST", f"{engine_process.url}/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.killpg(engine_process.process.pid, signal.SIGINT)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    assert engine_process.process.wait(timeout=60) == 0, engine_process.log.read_text()


@pytest.mark.e2e
def test_a_client_that_disconnects_mid_stream_frees_its_slot(one_slot):
    """One slot: the second request could not start before the first's 900 tokens, were its slot kept."""
    body = {"prompt": LONG_PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{one_slot.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    started = time.monotonic()
    second = one_slot.client.completions.create(model=MODEL, prompt="x = 1", max_tokens=8, temperature=0)
    assert second.usage.completion_tokens >= 1 and time.monotonic() - started < 30
    aborted = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
    assert one_slot.metrics()[aborted] == 1
    log = [line for line in one_slot.log.read_text().splitlines() if first["id"] in line and " 499 " in line]
    assert len(log) == 1 and "client disconnected" in log[0]
    # A client of a whole (not streamed) response that gives up is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{one_slot.url}/v1/completions", json={**body, "stream": False}, timeout=1.5)
    third = one_slot.client.completions.create(model=MODEL, prompt="y = 2", max_tokens=8, temperature=0)
    assert third.usage.completion_tokens >= 1 and one_slot.metrics()[aborted] == 2
    # The summary level: vLLM's fields without the per-step arrays.
    check_metrics(second.model_extra["metrics"]["speculative_decoding"], SUMMARY_FIELDS)


@pytest.mark.e2e
def test_sigterm_lets_requests_in_flight_finish_or_end_with_a_clear_error(one_slot):
    """A short request finishes; a long one (queued behind it in the one slot) ends with the shutdown's error
    after the 3 s drain, or finishes if it can; new requests are refused; the process exits 0."""
    streams = {}

    def read(name, max_tokens):
        body = {"prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{one_slot.url}/v1/completions", json=body, timeout=60) as response:
            streams[name] = [json.loads(line[6:]) for line in response.iter_lines()
                             if line.startswith("data: ") and line != "data: [DONE]"]

    threads = [threading.Thread(target=read, args=("short", 24)), threading.Thread(target=read, args=("long", 900))]
    running = ("vllm:num_requests_running", (("model_name", MODEL),))
    for count, thread in enumerate(threads, 1):
        thread.start()
        deadline = time.monotonic() + 30
        while one_slot.metrics().get(running, 0) < count:  # the short one first, then both in the server
            assert time.monotonic() < deadline
            time.sleep(0.02)
    one_slot.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises((httpx.TransportError, AssertionError)):
        refused = one_slot.post("/v1/completions", {"prompt": "x", "max_tokens": 4})
        assert refused.status_code == 200  # a 503 raises AssertionError; a closed socket a TransportError
    for thread in threads:
        thread.join(timeout=60)
    assert one_slot.process.wait(timeout=60) == 0
    short = streams["short"]
    assert short[-1]["choices"][0]["finish_reason"] == "length"
    long = streams["long"][-1]
    assert long.get("choices", [{}])[0].get("finish_reason") == "length" or (
        long["error"]["code"] == 503 and "the server shut down before this request finished" in long["error"]["message"])
    assert "shutting down: new requests get 503" in one_slot.log.read_text()


# ------------------------------------------------------------------------------ in-process: config and text

def test_an_unknown_method_is_refused_at_startup_naming_the_flag(capsys):
    assert cli.main(["serve", "--method", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--method" in err and "'nope'" in err and "'eagle'" in err
    assert cli.main(["serve", "--per-request-spec-decode-metrics", "summary"]) == 2
    assert "per_request_spec_decode_metrics = 'summary' is invalid" in capsys.readouterr().err
    assert cli.main(["serve", "--method", "eagle", "--per-request-spec-decode-metrics", "all"]) == 2
    assert "('none', 'summary', 'detailed')" in capsys.readouterr().err
    assert cli.main(["serve", "--max-model-len", "256", "--warmup-prompt-len", "256"]) == 2
    assert "ServeConfig.warmup_prompt_len = 256 is invalid: allowed null or an integer in 1..255" in capsys.readouterr().err
    assert cli.main(["serve", "--switch-interval-ms", "0"]) == 2
    assert "ServeConfig.switch_interval_ms = 0.0 is invalid: allowed milliseconds in (0, 100]" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_bad_setting_found_by_the_engine_process_is_refused_at_startup_naming_the_flag(capsys):
    """The child finds it (it loads the model) and the parent says it as the thread's server does."""
    assert cli.main(["serve", "--engine-process", "--max-model-len", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert "ServeConfig.max_model_len (--max-model-len) = 4096 is invalid: allowed at most the model's " \
           "max_position_embeddings 2048" in err, err


def test_the_config_from_yaml_flags_and_overrides(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("spec: {method: eagle, num_speculative_tokens: 3}\nmax_num_seqs: 2\nport: 9000\n")
    config = load_serve_config(path, {"port": 9001, "max_num_seqs": None}, ["spec.total_tokens=6", "spec.tree_top_k=2"])
    assert config.port == 9001 and config.max_num_seqs == 2  # a flag over the file; an absent flag keeps it
    assert (config.spec.method, config.spec.num_speculative_tokens, config.spec.total_tokens) == ("eagle", 3, 6)
    assert load_serve_config().spec is None and load_serve_config() == ServeConfig()
    with pytest.raises(ValueError, match=r"--set slots=3: unknown key 'slots' \(ServeConfig\)"):
        load_serve_config(None, {}, ["slots=3"])
    with pytest.raises(ValueError, match="has no method"):
        load_serve_config(None, {"num_speculative_tokens": 3})
    # --no-warmup-sampled, through the command line's parser to the config
    args = cli.build_parser().parse_args(["serve", "--no-warmup-sampled"])
    assert load_serve_config(None, {name: getattr(args, name) for name in FLAGS}).warmup_sampled is False
    assert ServeConfig().warmup_sampled is True
    args = cli.build_parser().parse_args(["serve", "--end-visits-on-finish", "--steps-per-visit", "4", "--visit-ends",
                                          "1"])
    config = load_serve_config(None, {name: getattr(args, name) for name in FLAGS})
    assert config.end_visits_on_finish is True and config.steps_per_visit == 4 and config.visit_ends == 1
    assert ServeConfig().visit_ends is None
    with pytest.raises(ValueError, match="ServeConfig.visit_ends = 0 is invalid: allowed null or an integer >= 1"):
        load_serve_config(None, {}, ["visit_ends=0"])
    assert ServeConfig().end_visits_on_finish is False
    with pytest.raises(ValueError, match="ServeConfig.warmup_sampled = 3 is invalid: allowed true or false"):
        load_serve_config(None, {}, ["warmup_sampled=3"])


def test_spec_decode_metrics_levels():
    counts = {"steps": 3, "drafted": 12, "accepted": 5, "length_histogram": [1, 0, 1, 1, 0],
              "per_step_accepted": [0, 3, 2], "per_step_drafted": [4, 4, 4]}
    assert spec_decode_metrics(counts, "none") is None
    check_metrics(spec_decode_metrics(counts, "summary"), SUMMARY_FIELDS)
    detailed = spec_decode_metrics(counts, "detailed")
    check_metrics(detailed, DETAILED_FIELDS)
    assert detailed["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)


@pytest.mark.parametrize("streams", [True, False], ids=["DecodeStream", "prefix"])
def test_streamed_text_never_breaks_a_character(tokenizer, streams):
    """Both ways of detokenizing (tokenizers' DecodeStream, and decoding the prefix again where a tokenizer cannot
    stream): multi-byte characters held back until whole, a character cut off at the end rendered as decode renders
    it, and a page of code in visits of a few ids joining to its decode."""
    text = "naïve café ✓ — 日本語 😀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several ids

    def detokenizer():
        made = Detokenizer(tokenizer)
        assert (made.stream is not None) or not streams  # the bundled tokenizer streams
        if not streams:
            made.stream = None
        return made

    one = detokenizer()
    pieces = [one.add([i]) for i in ids] + [one.add([], final=True)]
    assert "".join(pieces) == tokenizer.decode(ids) and not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces[:-1]  # some ids ended inside a character and were held back
    cut = detokenizer()  # the output ends inside the emoji's bytes
    assert cut.add(ids[:-2]) + cut.add([], final=True) == tokenizer.decode(ids[:-2])
    # A visit's chunk that ends inside a character emits at once all the text before that character.
    inside = max(j for j in range(len(ids)) if tokenizer.decode(ids[:j]).endswith("\ufffd"))
    early = detokenizer()
    first = early.add(ids[:inside])
    assert first == tokenizer.decode(ids[:inside]).rstrip("\ufffd") and inside > Detokenizer.TAIL + 1
    assert first + early.add(ids[inside:]) + early.add([], final=True) == tokenizer.decode(ids)
    code = tokenizer.encode(Path(detokenizer.__code__.co_filename).read_text()[:4000], add_special_tokens=False)
    visits = detokenizer()
    pieces = [visits.add(code[i:i + 5]) for i in range(0, len(code), 5)] + [visits.add([], final=True)]
    assert "".join(pieces) == tokenizer.decode(code)
