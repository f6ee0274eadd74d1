"""`specjax serve`: loads the models, warms the engine's programs up, and runs the app under uvicorn until
SIGTERM / SIGINT, after which requests in flight finish (or end with an error at the timeout)."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys

import jax
import prometheus_client
import uvicorn

from specjax import default_models, speed
from specjax.config import ConfigError
from specjax.engine import freeze_heap
from specjax.experiments import default_drafter, load_models, load_tokenizer
from specjax.models import hf
from specjax.proposers import proposer_class
from specjax.serve._app import Served, build_app
from specjax.serve._config import ServeConfig
from specjax.serve._metrics import ServerMetrics
from specjax.serve._process import EngineProcess
from specjax.serve._runner import EngineRunner

log = logging.getLogger("specjax.serve")


class _GracefulServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT starts the app's drain and ends with exit status 0
    (uvicorn re-raises a caught signal once it has shut down, which would end the process by that signal)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: stop now
            self.force_exit = True
            return
        self.should_exit = True
        self.on_exit()


def serve(config: ServeConfig) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # silences "PyTorch was not found"
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specjax").setLevel(logging.INFO)  # the access lines; other libraries' warnings only
    spec = config.spec
    method = None if spec is None else spec.method
    shaped = config.model.startswith(speed.SHAPE_PREFIX)  # random weights: the drafter is made, not loaded
    if method is not None and proposer_class(method).needs_drafter and not shaped \
            and default_drafter(config.model, method, config.drafter) is None:
        raise ConfigError(f"ServeConfig.drafter (--draft) is missing: method {method!r} needs a drafter folder "
                          f"(it has a bundled one only for --model {default_models.TARGET})")
    if config.engine_process:  # the weights load in the engine's process; this one needs the tokenizer only
        # This process must not take the device the child uses (XLA would reserve most of its memory here). A
        # config update, not JAX_PLATFORMS: the spawned child reads the environment and must see the GPU.
        jax.config.update("jax_platforms", "cpu")
        model, tokenizer, drafter = None, load_tokenizer(config.model), None
    else:
        model, tokenizer, drafter = load_models(config.model, method, config.drafter, config.dtype)
        config.check_model(model.config)
    eos = hf.eos_token_ids(default_models.resolve(config.model)) or (
        () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,))
    engine_config = config.engine_config(tuple(eos))
    # The engine thread and the HTTP event loop take turns on the interpreter lock: a short interval hands it back
    # to the engine soon after its device call returns.
    sys.setswitchinterval(config.switch_interval_ms / 1e3)
    prometheus_client.disable_created_metrics()  # as vLLM: no `_created` series beside every counter
    metrics = ServerMetrics(config.model_name)
    if config.engine_process:
        runner = EngineProcess(config, engine_config, metrics)
    else:
        runner = EngineRunner.for_server(model, engine_config, drafter, config, metrics)
    served = Served(config, runner, tokenizer, metrics, engine_config.lookahead)
    what = "autoregressive" if spec is None else (
        f"{spec.method} K={spec.num_speculative_tokens} ({spec.rejection_sample_method} verification"
        f"{', ' + str(spec.num_draft_nodes) + '-node tree' if spec.drafts_tree else ''})")
    log.info("compiling the engine's programs for %s: %s, %d slots of %d tokens", config.model_name, what,
             config.max_num_seqs, config.max_model_len)
    runner.warm_up(served.encode("def"), config.warmup_prompt_len, config.warmup_sampled)
    freeze_heap()  # with --engine-process the HTTP side's own; the child freezes the engine's
    runner.start()
    if not tokenizer.chat_template:
        log.info("the tokenizer has no chat template: chat prompts are 'role: content' lines, then 'assistant:'")
    # uvicorn parses HTTP with httptools where it is installed (a serve extra), else in pure Python (h11), which
    # costs the event loop, and so the engine's thread sharing its interpreter lock, ~20% more a request.
    parser = "httptools" if importlib.util.find_spec("httptools") else "h11 (pip install httptools: less CPU a request)"
    log.info("serving %s (%s) at http://%s:%d with %d slots; per-request speculative metrics: %s; HTTP parser: %s",
             config.model_name, what, config.host, config.port, config.max_num_seqs,
             config.per_request_spec_decode_metrics, parser)
    # uvicorn's own access log is off: the app writes one line per request, with its id and acceptance.
    uvicorn_config = uvicorn.Config(build_app(served), host=config.host, port=config.port, access_log=False,
                                    log_level="info", timeout_graceful_shutdown=int(config.shutdown_timeout_s) + 10)
    server = _GracefulServer(uvicorn_config, served.begin_drain)
    try:
        server.run()
    finally:
        runner.stop()
    log.info("stopped")
    return 1 if runner.failure is not None else 0
