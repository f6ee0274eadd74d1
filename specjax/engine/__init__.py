"""A serving engine: continuous batching with speculative decoding (docs/serving.md).

    engine = Engine(target, EngineConfig(max_num_seqs=16, spec=SpecConfig(method="eagle")), drafter=head)
    outputs = engine.run([Request.make("r0", prompt, 64, temperature=0.7, seed=1), ...])
"""

from specjax.engine._config import EngineConfig
from specjax.engine._engine import Engine
from specjax.engine._heap import GcPauses, freeze_heap
from specjax.engine._pacing import VisitPacing
from specjax.engine._programs import prefill_pieces
from specjax.engine._request import Request, RequestError, RequestOutput, check_request

__all__ = ["Engine", "EngineConfig", "GcPauses", "Request", "RequestError", "RequestOutput", "VisitPacing",
           "check_request", "freeze_heap", "prefill_pieces"]
