"""`specjax serve`: an OpenAI-compatible HTTP server on the engine (docs/serving.md, "The server").

    specjax serve --method eagle --per-request-spec-decode-metrics summary     # the bundled models

/v1/completions and /v1/chat/completions (whole or streamed), /v1/models, /health and /metrics
(Prometheus, vLLM's speculative counters). Needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""

from specjax.serve._config import FLAGS, METRICS_LEVELS, ServeConfig, load_serve_config
from specjax.serve._runner import EngineRunner, EventReader
from specjax.serve._spec_metrics import spec_decode_metrics
from specjax.serve._text import Detokenizer


def serve(config: ServeConfig) -> int:
    """Serves until SIGTERM / SIGINT; the exit status (0 after a graceful shutdown)."""
    try:
        from specjax.serve._server import serve as run
    except ImportError as error:
        raise RuntimeError(f"specjax serve needs the serve extra ({error.name} is missing): "
                           "pip install 'specjax[serve]'") from error
    return run(config)


__all__ = ["FLAGS", "METRICS_LEVELS", "Detokenizer", "EngineRunner", "EventReader", "ServeConfig", "load_serve_config",
           "serve", "spec_decode_metrics"]
