"""The engine's settings: EngineConfig, each field documented where it is declared and checked when it is built."""

from __future__ import annotations

import dataclasses

from specjax import adaptive
from specjax.config import SpecConfig
from specjax.proposers import proposer_class


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs; each field's allowed values are checked when it is built."""

    # Requests decoded at once (the state's rows, vLLM's max_num_seqs).
    max_num_seqs: int = 16
    # Cache slots a request may use: prompt + max_tokens + drafts scored per step + 1 (vLLM's max_model_len).
    max_model_len: int = 512
    # Speculative decoding (vLLM's SpeculativeConfig names); None decodes autoregressively.
    spec: SpecConfig | None = None
    # Device steps between host visits at most; a visit comes sooner when rows end and requests wait (and
    # when a row ends and the caller asked for that: a server's, Engine.step's end_on_finish).
    steps_per_visit: int = 16
    # With requests waiting, a visit stops once this many of its rows ended (or as many as wait, if fewer). None:
    # chosen before each visit from the last visits' host time, step time and rate of ends (engine/_pacing.py),
    # 1 with async_scheduling (whose host work overlaps the device's); 1: at the first end. With None the visits
    # follow measured times: outputs are the same, but which requests share a step may differ between two runs,
    # and with adaptive verification (whose widths depend on the rows a step holds) so may the acceptance counts;
    # a fixed count makes the schedule a function of the requests alone.
    visit_ends: int | None = None
    # The model's EOS ids: a row ends after emitting one (requests add their own stop_token_ids).
    eos_token_ids: tuple[int, ...] = ()
    # Requests admitted by one prefill call at most (its rows are padded to a power of two).
    max_prefill_batch: int = 8
    # A prefill call's fixed cost in padded rows' worth (its weight read and launches): an admission splits into
    # calls of power-of-two rows where that pads fewer rows by more than this per extra call (prefill_pieces: 20
    # requests as 16 + 4 rather than one call of 32). 0 splits wherever it saves padding; float("inf") (the default:
    # measured at the 8B shape, 2 lost 3%, docs/performance.md) never splits.
    prefill_call_rows: float = float("inf")
    kv_cache_dtype: str | None = None  # the target's cache dtype (None: the model's)
    # Prefix caching (vLLM's name): full prompt blocks of the target's and the drafter's caches kept in a pool
    # beside the slots, keyed by a hash chain of their tokens; a request's matched blocks are copied into its
    # slot and only the rest is prefilled (engine/_blocks.py; saves prefill compute, not memory).
    enable_prefix_caching: bool = False
    block_size: int = 16  # prompt tokens per cached block (vLLM's block_size)
    num_prefix_blocks: int = 256  # blocks the pool holds; unreferenced ones are evicted least recently used first
    # Keep the last matched block for drafters whose cache entry at i depends on token i + 1 (EAGLE;
    # Proposer.draft_kv_reads_next_token), which vLLM drops and recomputes: measures what reusing it does to
    # acceptance (vLLM's disable_eagle_block_drop). Outputs stay lossless either way.
    disable_eagle_block_drop: bool = False
    # Prompt tokens prefilled per visit at most (vLLM's max_num_batched_tokens, with chunked prefill on): a
    # longer prompt is prefilled in chunks over several visits while the running requests step between them.
    # None: whole prompts, max_prefill_batch of them a call.
    max_num_batched_tokens: int | None = None
    # With spec.enable_adaptive_verification: a step's cost by batch and verify width (specjax.adaptive);
    # None: adaptive.default_cost_curve at each count of slots stepped (profiled once and cached on an
    # accelerator, analytic on the CPU).
    cost_curve: adaptive.CostCurve | None = None
    # With adaptive verification: after a visit whose last step chose width w, the next visit runs a program held at
    # w with no switch (to its end, or to a step that would have chosen another: adaptive_held_whole_visits; the
    # engine's docstring, "held visits"): on a GPU the switch's program steps slower than a fixed-width one (its
    # branches gain less from CUDA graphs, docs/performance.md), so a load whose choice stays put pays for no switch.
    # Lossless either way (the program is chosen from past steps); one more step program a count of slots stepped and
    # width worth choosing there.
    adaptive_held_visits: bool = True
    # Held visits that run whole: a step whose choice moved ends no visit (the visit keeps its width to the end, and
    # the next one is held at its last step's choice). No visit ends early to change width, for a width up to a
    # visit late; False: a moved choice ends the visit, a round trip to the host each move. Whole visits served 1.01x
    # (1 request), 1.07x (16) and 1.08x (64) what visits ending at a moved choice did on an H100 (docs/performance.md,
    # twenty-sixth session). Moot without adaptive_held_visits.
    adaptive_held_whole_visits: bool = True
    # Draft KV offload (vLLM-style name): the drafter's KV cache lives in pinned host memory, one buffer per slot;
    # each visit brings the stepped slots' buffers to the device and sends them back (engine/_offload.py). Frees
    # the draft cache's device memory between visits and for the slots a visit does not step, for a host-device
    # copy of the stepped rows' draft cache each way per visit. Needs a drafter that keeps a KV cache and a device
    # with a pinned_host memory kind.
    draft_kv_offload: bool = False
    # Async scheduling (vLLM's name): each visit is dispatched, from a thread of the engine's (on a GPU the call
    # returns only when its loop has ended), before the host reads the visit before it, so that reading tokens,
    # ending requests and streaming them overlap the device's next visit. A request's end is known, and its slot
    # refilled, one visit later; outputs are the same. Not with draft_kv_offload (its buffers move at each visit).
    async_scheduling: bool = False
    # Mixed prefill (vLLM's chunked prefill, where one step's batch holds decode tokens and prompt chunks): an
    # admitted request waits in its slot while each decode step also prefills up to mixed_prefill_chunks chunks of
    # mixed_prefill_tokens prompt tokens in the same forward (their projections and MLP share the step's weight
    # reads: a memory-bound step prefills for about the compute), and decodes from the step after its prompt's last
    # chunk; with speculation the drafter's state is extended by each chunk too, one chunk of a prompt a step. None:
    # prompts are prefilled in calls of their own between visits. Not with max_num_batched_tokens, which it replaces,
    # nor with draft_kv_offload, nor with prefix caching and speculation together.
    mixed_prefill_tokens: int | None = None
    mixed_prefill_chunks: int = 1  # prompt chunks a mixed step prefills at most
    # The counts of slots a visit may step (as vLLM's cudagraph_capture_sizes): a visit steps the smallest that holds
    # every busy slot (busy slots are kept first), and each is one step program compiled at warm-up, with adaptive
    # verification one cost profile too. Increasing, ending with max_num_seqs. None: the powers of two below
    # max_num_seqs, and max_num_seqs. Fewer counts warm up sooner (an adaptive engine at the 8B shape takes about
    # 200 s a count on an H100, docs/performance.md) for idle slots stepped between them.
    step_slot_counts: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "steps_per_visit", "max_prefill_batch", "block_size",
                     "num_prefix_blocks", "mixed_prefill_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} = {value!r} is invalid: allowed an integer >= 1")
        for name in ("max_num_batched_tokens", "mixed_prefill_tokens", "visit_ends"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"EngineConfig.{name} = {value!r} is invalid: allowed None or an integer >= 1")
        if self.mixed_prefill_tokens is not None:
            for name, value, allowed in (
                    ("max_num_batched_tokens", self.max_num_batched_tokens, "None"),
                    ("draft_kv_offload", self.draft_kv_offload, "False"),
                    ("enable_prefix_caching", self.enable_prefix_caching and self.spec is not None,
                     "False with speculation")):
                if value not in (None, False):
                    raise ValueError(f"EngineConfig.{name} = {value} is invalid with mixed_prefill_tokens = "
                                     f"{self.mixed_prefill_tokens}: allowed {allowed}")
        if self.step_slot_counts is not None:
            counts = list(self.step_slot_counts) if isinstance(self.step_slot_counts, (list, tuple)) else None
            if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts) or (
                    counts != sorted(set(counts)) or counts[-1] != self.max_num_seqs):
                raise ValueError(f"EngineConfig.step_slot_counts = {self.step_slot_counts!r} is invalid: allowed None "
                                 f"or increasing integers >= 1 ending with max_num_seqs ({self.max_num_seqs})")
            object.__setattr__(self, "step_slot_counts", tuple(counts))
        if isinstance(self.prefill_call_rows, bool) or not isinstance(self.prefill_call_rows, (int, float)) or not (
                self.prefill_call_rows >= 0):
            raise ValueError(f"EngineConfig.prefill_call_rows = {self.prefill_call_rows!r} is invalid: allowed a "
                             f"number >= 0 (float('inf') never splits an admission)")
        for name in ("enable_prefix_caching", "disable_eagle_block_drop", "draft_kv_offload", "async_scheduling",
                     "adaptive_held_visits", "adaptive_held_whole_visits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} = {getattr(self, name)!r} is invalid: allowed True or False")
        if self.spec is not None and not proposer_class(self.spec.method).defines_extend():
            for name, off in (("enable_prefix_caching", False), ("max_num_batched_tokens", None),
                              ("mixed_prefill_tokens", None)):
                if getattr(self, name) != off:  # each continues a prefill, which this drafter's state cannot
                    raise ValueError(f"EngineConfig.{name} = {getattr(self, name)} is invalid with method "
                                     f"{self.spec.method!r}, whose drafter defines no extend: allowed {off}")
        if self.disable_eagle_block_drop and not self.enable_prefix_caching:
            raise ValueError("EngineConfig.disable_eagle_block_drop = True is invalid without enable_prefix_caching: "
                             "allowed only with enable_prefix_caching = True")
        if self.draft_kv_offload and self.spec is None:
            raise ValueError("EngineConfig.draft_kv_offload = True is invalid without speculation (spec = None): "
                             "allowed only with a spec whose drafter keeps a KV cache")
        if self.async_scheduling and self.draft_kv_offload:
            raise ValueError("EngineConfig.async_scheduling = True is invalid with draft_kv_offload = True: allowed "
                             "with one of them at most")

    @property
    def lookahead(self) -> int:
        """Cache slots a step may write past the last committed token."""
        return 0 if self.spec is None else self.spec.num_draft_nodes + 1
