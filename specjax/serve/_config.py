"""The server's settings: one frozen dataclass, from a YAML file, command-line flags and `--set` overrides."""

from __future__ import annotations

import dataclasses

from specjax.config import ConfigError, SpecConfig, from_dict, parse_yaml, require, with_overrides
from specjax.engine import EngineConfig

# vLLM's --per-request-spec-decode-metrics levels: no metrics object, the summary, the summary and per-step arrays.
METRICS_LEVELS = ("none", "summary", "detailed")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """`specjax serve`: what it serves and how (the flag of each field in parentheses)."""

    # The target: a Hugging Face folder, default:NAME for a bundled model, or shape:8b for random weights at
    # Llama-3.1-8B's sizes with a drafter made to match (load tests; synthetic acceptance) (--model).
    model: str = "default:target"
    # The drafter's folder (--draft); None with the bundled target: the method's bundled drafter.
    drafter: str | None = None
    # Speculative decoding, vLLM's names (--method, --num-speculative-tokens, --rejection-sample-method; trees
    # with spec.total_tokens / spec.tree_top_k or spec.speculative_token_tree); None serves autoregressively.
    spec: SpecConfig | None = None
    # The name clients give as `model` and /v1/models lists (None: `model` as given).
    served_model_name: str | None = None
    # Requests decoded at once, the engine's slots (--max-num-seqs); more wait in its FIFO.
    max_num_seqs: int = 8
    # Cache entries a request may use: prompt + max_tokens + drafts scored a step + 1 (--max-model-len).
    max_model_len: int = 1024
    # The engine's prefix caching and chunked prefill, vLLM's names (--enable-prefix-caching,
    # --max-num-batched-tokens; specjax.engine.EngineConfig says what each does).
    enable_prefix_caching: bool = False
    disable_eagle_block_drop: bool = False
    max_num_batched_tokens: int | None = None
    # Prompts prefilled by the decode steps, chunks of this many tokens (--mixed-prefill-tokens), up to
    # mixed_prefill_chunks a step (--mixed-prefill-chunks) (EngineConfig's fields).
    mixed_prefill_tokens: int | None = None
    mixed_prefill_chunks: int = 1
    # The counts of slots a visit may step, each a step program compiled at warm-up (EngineConfig.step_slot_counts;
    # --set step_slot_counts=[1,16,64,256]); None: powers of two up to max_num_seqs.
    step_slot_counts: tuple[int, ...] | None = None
    # With spec.enable_adaptive_verification: visits held at the width the last one chose, with no switch, while
    # each step chooses it again (EngineConfig.adaptive_held_visits; --set adaptive_held_visits=false turns them off).
    adaptive_held_visits: bool = True
    # Held visits run whole, a moved choice ending none (EngineConfig.adaptive_held_whole_visits; --set
    # adaptive_held_whole_visits=false: a moved choice ends the visit).
    adaptive_held_whole_visits: bool = True
    # Prompts of up to this many tokens find every program compiled before the server listens (each admission
    # batch and step bucket, greedy and sampled: Engine.warmup); None: only short requests are warmed, and the
    # first requests of other lengths or larger batches compile theirs (seconds each at the 8B shape).
    warmup_prompt_len: int | None = None
    # Whether the warm-up compiles the sampled programs too (the greedy ones always): False leaves them to the
    # first sampled request, which then waits for them (116 s at the 8B shape on the H200), for a server that
    # expects greedy requests, or a benchmark sending only those (--no-warmup-sampled).
    warmup_sampled: bool = True
    # Compute dtype of target and drafter (None: the checkpoints').
    dtype: str | None = None
    host: str = "127.0.0.1"  # --host
    port: int = 8000  # --port
    # vLLM's per-request metrics object in each response (--per-request-spec-decode-metrics).
    per_request_spec_decode_metrics: str = "none"
    # Seconds in-flight requests get to finish after SIGTERM / SIGINT; then they end with an error.
    shutdown_timeout_s: float = 30.0
    # Milliseconds the engine's thread may hold a visit to gather arriving requests (a visit admits nothing while
    # it runs): after requests ended, until their replacements are in, for at most 5% of the last visit's time;
    # at an idle engine, until a 2 ms gap between arrivals (serve/_runner.py). 0: start each visit at once
    # (--admit-wait-ms).
    admit_wait_ms: float = 50.0
    # Steps an engine visit runs at most (EngineConfig.steps_per_visit; vLLM V0's --num-scheduler-steps): a visit
    # admits nothing while it runs, so over HTTP a request that arrives just after a visit began waits it out. Fewer
    # steps: shorter waits for more host work (docs/performance.md, a stand-in engine at the 8B shape's times)
    # (--steps-per-visit).
    steps_per_visit: int = 16
    # With requests waiting, the rows a visit lets end before it stops to admit them (EngineConfig.visit_ends):
    # null, as many as the last visits' host and step times make worth a visit; 1, at the first end (--visit-ends).
    visit_ends: int | None = None
    # End a visit when a request ends, as one does in process when requests wait, rather than after
    # steps_per_visit: its replacement is on the way (EngineRunner's end_on_finish; --end-visits-on-finish).
    end_visits_on_finish: bool = False
    # The engine's async scheduling (vLLM's --async-scheduling; specjax.engine.EngineConfig): each visit dispatched
    # before the host reads the one before it, so that streaming and bookkeeping overlap the device's next visit.
    async_scheduling: bool = False
    # Requests admitted by one prefill call at most (the engine's max_prefill_batch; --max-prefill-batch).
    max_prefill_batch: int = 8
    # Seconds between the engine's stats lines in the log while it works (requests running and waiting, visits,
    # steps, slots stepped, prefills, tokens/s, device share); 0: none (--log-stats-interval).
    log_stats_interval_s: float = 10.0
    # Python's thread switch interval in the server process (sys.setswitchinterval), milliseconds. The engine's
    # thread releases the interpreter lock at every device call and, under load, waits up to this long to get
    # it back from the HTTP event loop; Python's 5 ms default cost 6% of the bundled models' throughput on the
    # CPU at 16 clients (docs/performance.md) (--switch-interval-ms).
    switch_interval_ms: float = 0.5
    # The engine in a child process (serve/_process.py; vLLM's API server and engine core) rather than a thread of
    # the HTTP server's, so that the two stop sharing Python's interpreter lock (--engine-process).
    engine_process: bool = False
    # A folder for profiler traces: with it, POST /start_profile and /stop_profile (vLLM's endpoints) trace the
    # process with JAX's profiler, one subfolder a trace, and /stop_profile answers what the trace says about the
    # device's time (specjax.profiling); without it they answer 404 (--profile-dir).
    profile_dir: str | None = None

    def __post_init__(self):
        from specjax.proposers import PROPOSERS
        from specjax.verify import rejection_sample_methods

        for name in ("max_num_seqs", "max_model_len", "max_prefill_batch", "steps_per_visit"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, "ServeConfig", name, value, "an integer >= 1")
        require(self.visit_ends is None or (isinstance(self.visit_ends, int) and self.visit_ends >= 1), "ServeConfig",
                "visit_ends", self.visit_ends, "null or an integer >= 1")
        require(isinstance(self.port, int) and 0 <= self.port < 65536, "ServeConfig", "port", self.port,
                "an integer in 0..65535 (0: any free port)")
        require(self.warmup_prompt_len is None or (isinstance(self.warmup_prompt_len, int)
                                                    and 1 <= self.warmup_prompt_len < self.max_model_len),
                "ServeConfig", "warmup_prompt_len", self.warmup_prompt_len,
                f"null or an integer in 1..{self.max_model_len - 1} (below max_model_len)")
        require(isinstance(self.end_visits_on_finish, bool), "ServeConfig", "end_visits_on_finish",
                self.end_visits_on_finish, "true or false")
        require(isinstance(self.async_scheduling, bool), "ServeConfig", "async_scheduling", self.async_scheduling,
                "true or false")
        require(isinstance(self.adaptive_held_visits, bool), "ServeConfig", "adaptive_held_visits",
                self.adaptive_held_visits, "true or false")
        require(isinstance(self.adaptive_held_whole_visits, bool), "ServeConfig", "adaptive_held_whole_visits",
                self.adaptive_held_whole_visits, "true or false")
        require(isinstance(self.warmup_sampled, bool), "ServeConfig", "warmup_sampled", self.warmup_sampled,
                "true or false")
        require(isinstance(self.admit_wait_ms, (int, float)) and self.admit_wait_ms >= 0, "ServeConfig",
                "admit_wait_ms", self.admit_wait_ms, "milliseconds >= 0")
        require(isinstance(self.log_stats_interval_s, (int, float)) and self.log_stats_interval_s >= 0,
                "ServeConfig", "log_stats_interval_s", self.log_stats_interval_s, "seconds >= 0")
        require(isinstance(self.switch_interval_ms, (int, float)) and 0 < self.switch_interval_ms <= 100,
                "ServeConfig", "switch_interval_ms", self.switch_interval_ms, "milliseconds in (0, 100]")
        require(self.shutdown_timeout_s >= 0, "ServeConfig", "shutdown_timeout_s", self.shutdown_timeout_s,
                "seconds >= 0")
        require(self.per_request_spec_decode_metrics in METRICS_LEVELS, "ServeConfig",
                "per_request_spec_decode_metrics", self.per_request_spec_decode_metrics, f"one of {METRICS_LEVELS}")
        if self.spec is None:
            # vLLM refuses per-request speculative metrics without a speculative config too.
            require(self.per_request_spec_decode_metrics == "none", "ServeConfig", "per_request_spec_decode_metrics",
                    self.per_request_spec_decode_metrics, "'none' without speculative decoding (give --method)")
            return
        # A server cannot serve a method it does not have: refused at startup, naming the flag.
        require(self.spec.method in PROPOSERS, "ServeConfig", "spec.method (--method)", self.spec.method,
                f"one of {sorted(PROPOSERS)}")
        require(self.spec.rejection_sample_method in rejection_sample_methods(), "ServeConfig",
                "spec.rejection_sample_method (--rejection-sample-method)", self.spec.rejection_sample_method,
                f"one of {rejection_sample_methods()}")

    def engine_config(self, eos_token_ids: tuple[int, ...]) -> EngineConfig:
        """The engine's settings this config serves with."""
        return EngineConfig(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, spec=self.spec,
                            eos_token_ids=tuple(eos_token_ids), enable_prefix_caching=self.enable_prefix_caching,
                            disable_eagle_block_drop=self.disable_eagle_block_drop,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            mixed_prefill_tokens=self.mixed_prefill_tokens,
                            mixed_prefill_chunks=self.mixed_prefill_chunks, max_prefill_batch=self.max_prefill_batch,
                            async_scheduling=self.async_scheduling, steps_per_visit=self.steps_per_visit,
                            visit_ends=self.visit_ends, step_slot_counts=self.step_slot_counts,
                            adaptive_held_visits=self.adaptive_held_visits,
                            adaptive_held_whole_visits=self.adaptive_held_whole_visits)

    def check_model(self, model_config) -> None:
        """Refuses a max_model_len past the loaded model's positions, naming the flag."""
        require(self.max_model_len <= model_config.max_position_embeddings, "ServeConfig",
                "max_model_len (--max-model-len)", self.max_model_len,
                f"at most the model's max_position_embeddings {model_config.max_position_embeddings}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


# Command-line flags -> the config keys they set (dotted: inside spec).
FLAGS = {"model": "model", "draft": "drafter", "method": "spec.method",
         "num_speculative_tokens": "spec.num_speculative_tokens",
         "rejection_sample_method": "spec.rejection_sample_method", "max_num_seqs": "max_num_seqs",
         "max_model_len": "max_model_len", "host": "host", "port": "port",
         "per_request_spec_decode_metrics": "per_request_spec_decode_metrics",
         "served_model_name": "served_model_name", "dtype": "dtype", "shutdown_timeout": "shutdown_timeout_s",
         "enable_prefix_caching": "enable_prefix_caching", "max_num_batched_tokens": "max_num_batched_tokens",
         "mixed_prefill_tokens": "mixed_prefill_tokens", "mixed_prefill_chunks": "mixed_prefill_chunks",
         "warmup_prompt_len": "warmup_prompt_len", "warmup_sampled": "warmup_sampled", "admit_wait_ms": "admit_wait_ms",
         "steps_per_visit": "steps_per_visit", "visit_ends": "visit_ends",
         "end_visits_on_finish": "end_visits_on_finish",
         "async_scheduling": "async_scheduling",
         "max_prefill_batch": "max_prefill_batch", "log_stats_interval": "log_stats_interval_s",
         "switch_interval_ms": "switch_interval_ms", "profile_dir": "profile_dir", "engine_process": "engine_process"}


def load_serve_config(path=None, flags: dict | None = None, overrides=()) -> ServeConfig:
    """A ServeConfig from a YAML file (optional), then the flags given (FLAGS' names; None: not given),
    then `key=value` overrides, each over the one before."""
    from pathlib import Path

    data, where = {}, "command line"
    if path is not None:
        if not Path(path).exists():
            raise ConfigError(f"config file {path} does not exist")
        data, where = parse_yaml(Path(path).read_text(), str(path)) or {}, str(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for ServeConfig, got {type(data).__name__}")
    given = [f"{FLAGS[name]}={_yaml_scalar(value)}" for name, value in (flags or {}).items() if value is not None]
    data = with_overrides(ServeConfig, data, [*given, *overrides])
    if isinstance(data.get("spec"), dict) and not data["spec"].get("method"):
        raise ConfigError(f"{where}: ServeConfig.spec = {data['spec']!r} has no method: give --method "
                          "(or spec.method), or no speculative settings to serve autoregressively")
    return from_dict(ServeConfig, data, where)


def _yaml_scalar(value) -> str:
    """value written so that the override's YAML parse gives it back (a flag's string stays a string)."""
    import json

    return json.dumps(value)
