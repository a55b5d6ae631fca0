"""The sim engine's HTTP API, shaped as vLLM's OpenAI-compatible server serves it.

Routes: POST /v1/completions, /v1/chat/completions (streaming or not), GET /v1/models,
/health, /ping, /version, /metrics, POST /tokenize, /detokenize, the token-protected
migration hooks: GET /admin/requests, POST /admin/export, POST /admin/import, GET /admin/sleep,
and with VLLM_SERVER_DEV_MODE=1 vLLM's sleep mode: POST /sleep, POST /wake_up, GET
/is_sleeping (docs/sim-engine.md, "Sleep mode").

Errors use vLLM's body and status codes (400 bad request, 401 wrong API key, 404 unknown model,
413 body too large, 503 while loading). n > 1 is refused with a 400.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any

import orjson

from flexpipe import __version__ as flexpipe_version
from flexpipe.engine.args import EngineConfig
from flexpipe.engine.build import engine_core
from flexpipe.engine.metrics import CONTENT_TYPE, EngineMetrics
from flexpipe.engine.request import EngineRequest, SamplingParams, context_error
from flexpipe.engine.runner import Engine
from flexpipe.engine.sleep_api import SleepApi
from flexpipe.engine.stream import FinishSink, SseStream
from flexpipe.engine.tokenizer import Tokenizer, message_text
from flexpipe.http.server import (
    App,
    HttpError,
    PushResponse,
    Request,
    Response,
    error_response,
    json_response,
)
from flexpipe.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    ValidRequest,
    parse_chat_request,
    parse_completion_request,
    validate_messages,
)

VLLM_COMPAT_VERSION = "0.11.0"
_BAD_BANDWIDTH = "bandwidth_bytes_per_s must be > 0"


def _now_s() -> int:
    return int(time.time())


class SimServer:
    """Everything one sim engine process serves: engine, tokenizer, metrics, routes."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        pm = cfg.pm
        gear = cfg.gear
        self.tokenizer = Tokenizer(cfg.model.vocab_size)
        core = engine_core(cfg)
        self.scheduler = core.scheduler
        self.block_manager = core.scheduler.bm
        cache_config = {
            "block_size": gear.block_size,
            "cache_dtype": gear.kv_cache_dtype,
            "enable_prefix_caching": gear.enable_prefix_caching,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "num_cpu_blocks": 0,
            "num_gpu_blocks": cfg.num_kv_blocks,
            "num_gpu_blocks_override": (
                cfg.num_kv_blocks if cfg.num_kv_blocks != pm.memory.num_kv_blocks else None
            ),
            "sliding_window": None,
            "swap_space": 0,
        }
        self.metrics = EngineMetrics(
            cfg.served_model_name, self.scheduler, cfg.max_model_len, cache_config
        )
        self.engine = Engine(self.scheduler, core.step_time_s, self.metrics, cfg.time_scale)
        self.sleep_api = SleepApi(cfg, self.engine, self.scheduler, self._check_admin)
        if cfg.enable_sleep_mode:
            self.metrics.sleep = self.sleep_api.state
        self.model_name = cfg.served_model_name
        self._model_json = orjson.dumps(self.model_name)
        # secrets as bytes, compared in constant time (hmac.compare_digest)
        self._api_key = cfg.api_key.encode() if cfg.api_key is not None else None
        self._admin_token = cfg.admin_token.encode() if cfg.admin_token is not None else None
        # token id -> its text as a JSON string (a streamed token costs no encoding)
        self._frag_json = {t: orjson.dumps(f) for t, f in self.tokenizer.gen_fragments.items()}
        self._id_prefix = uuid.uuid4().hex[:16]
        self._num_ids = 0
        self.ready_at = 0.0
        self.started_at = 0.0
        self.app = App(max_body_bytes=cfg.max_request_body_bytes)
        self._routes()

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; /health turns 200 after the (scaled) modelled cold start."""
        self.started_at = time.monotonic()
        self.ready_at = self.started_at + self.cfg.load_time_s * self.cfg.time_scale
        self.metrics.watch_gc()
        self.engine.start()

    async def stop(self) -> None:
        self.metrics.unwatch_gc()
        await self.engine.stop()

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    def _routes(self) -> None:
        a = self.app
        a.add_route("POST", "/v1/completions", self.completions)
        a.add_route("POST", "/v1/chat/completions", self.chat_completions)
        a.add_route("GET", "/v1/models", self.models)
        a.add_route("GET", "/health", self.health)
        a.add_route("GET", "/ping", self.health)
        a.add_route("GET", "/version", self.version)
        a.add_route("GET", "/metrics", self.metrics_endpoint)
        a.add_route("POST", "/tokenize", self.tokenize)
        a.add_route("POST", "/detokenize", self.detokenize)
        a.add_route("GET", "/admin/requests", self.admin_requests)
        a.add_route("POST", "/admin/export", self.admin_export)
        a.add_route("POST", "/admin/import", self.admin_import)
        a.add_route("GET", "/admin/sleep", self.sleep_api.admin_sleep)
        if self.cfg.server_dev_mode:  # as vLLM: dev-mode endpoints only
            a.add_route("POST", "/sleep", self.sleep_api.sleep)
            a.add_route("POST", "/wake_up", self.sleep_api.wake_up)
            a.add_route("GET", "/is_sleeping", self.sleep_api.is_sleeping)

    # --- checks --------------------------------------------------------------------------
    def _check_api_key(self, req: Request) -> None:
        key = self._api_key
        if key is not None and not _bearer_matches(req.headers.get("authorization"), key):
            raise HttpError(401, "Unauthorized", "AuthenticationError")

    def _check_ready(self) -> None:
        if not self.ready:
            raise HttpError(503, "The model is still loading", "ServiceUnavailableError")

    def _check_model(self, model: Any) -> None:
        if model is not None and model not in self.cfg.served_model_names:
            raise HttpError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _check_admin(self, req: Request) -> None:
        token = self._admin_token
        if token is None:
            raise HttpError(403, "the admin API is disabled: start with --admin-token")
        given = req.headers.get("x-admin-token")
        if given is None:
            auth = req.headers.get("authorization") or ""
            given = auth.removeprefix("Bearer ")
        if not _secret_matches(given, token):
            raise HttpError(401, "wrong or missing admin token", "AuthenticationError")

    def _valid(
        self, req: Request, chat: bool, strict_content_type: bool = True
    ) -> ValidRequest[ChatCompletionRequest] | ValidRequest[CompletionRequest]:
        """The body validated against the OpenAI schema (flexpipe.protocol); a 400 otherwise.
        As vLLM: a body not declared application/json is a 400 (`strict_content_type`)."""
        content_type = req.headers.get("content-type")
        try:
            if chat:
                return parse_chat_request(req.body, content_type, not strict_content_type)
            return parse_completion_request(req.body, content_type, not strict_content_type)
        except RequestError as exc:
            raise HttpError(exc.status, exc.message, exc.type, exc.param) from None

    def _json_object(self, req: Request) -> dict[str, Any]:
        body = req.json()
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return body

    # --- simple endpoints ----------------------------------------------------------------
    async def health(self, req: Request) -> Response:
        if not self.ready:
            return error_response(503, "loading model weights", "ServiceUnavailableError")
        return Response(b"", content_type="text/plain")

    async def version(self, req: Request) -> Response:
        return json_response({"version": VLLM_COMPAT_VERSION, "flexpipe_sim": flexpipe_version})

    async def metrics_endpoint(self, req: Request) -> Response:
        return Response(self.metrics.render(), content_type=CONTENT_TYPE)

    async def models(self, req: Request) -> Response:
        self._check_api_key(req)
        created = int(time.time())
        data: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.cfg.model_path,
                "parent": None,
                "max_model_len": self.cfg.max_model_len,
                "permission": [],
            }
            for name in self.cfg.served_model_names
        ]
        return json_response({"object": "list", "data": data})

    async def tokenize(self, req: Request) -> Response:
        self._check_api_key(req)
        body = self._json_object(req)
        self._check_model(body.get("model"))
        add_special = bool(body.get("add_special_tokens", True))
        if "messages" in body:
            messages = body["messages"]
            try:
                validate_messages(messages)
            except RequestError as exc:
                raise HttpError(400, exc.message, exc.type, exc.param) from None
            text = self.tokenizer.apply_chat_template(
                messages, bool(body.get("add_generation_prompt", True))
            )
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise HttpError(400, "either prompt (a string) or messages is required")
        ids = self.tokenizer.encode(text, add_special)
        strs = [self.tokenizer.token_str(t) for t in ids] if body.get("return_token_strs") else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.cfg.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, req: Request) -> Response:
        self._check_api_key(req)
        body = self._json_object(req)
        self._check_model(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise HttpError(400, "tokens must be a list of token ids", param="tokens")
        return json_response({"prompt": self.tokenizer.decode(tokens)})

    # --- generation ----------------------------------------------------------------------
    async def completions(self, req: Request) -> Response | PushResponse:
        self._check_api_key(req)
        valid = self._valid(req, chat=False)
        self._check_model(valid.model)
        self._check_ready()
        assert isinstance(valid.request, CompletionRequest)
        prompt_ids = self._completion_prompt(valid.request.prompt)
        return await self._generate(req, valid, prompt_ids)

    async def chat_completions(self, req: Request) -> Response | PushResponse:
        self._check_api_key(req)
        valid = self._valid(req, chat=True)
        self._check_model(valid.model)
        self._check_ready()
        assert isinstance(valid.request, ChatCompletionRequest)
        # the template reads the validated body's plain dicts (content: str or parts)
        text = self.tokenizer.apply_chat_template(
            valid.body["messages"], valid.request.add_generation_prompt
        )
        prompt_ids = self.tokenizer.encode(text)
        return await self._generate(req, valid, prompt_ids)

    def _completion_prompt(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[int]:
        """Token ids of a validated prompt (one prompt: the sim engine serves no batches)."""
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            raise HttpError(
                400, "batched prompts are not supported by the sim engine", param="prompt"
            )
        one = prompt[0] if isinstance(prompt, list) and not isinstance(prompt[0], int) else prompt
        if isinstance(one, str):
            return self.tokenizer.encode(one)
        ids = [t for t in one if isinstance(t, int)]  # all of them (validated)
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in ids):
            raise HttpError(400, f"token ids must be in [0, {vocab})", param="prompt")
        return ids

    def _sampling(
        self, r: ChatCompletionRequest | CompletionRequest, num_prompt: int
    ) -> SamplingParams:
        """Sampling params of a validated request (types and ranges were checked by the
        schema; what is left depends on this engine: the context length)."""
        max_tokens = r.output_limit
        too_long = context_error(num_prompt, max_tokens, self.cfg.max_model_len)
        if too_long:
            raise HttpError(400, too_long, param="max_tokens" if max_tokens else "messages")
        stop = r.stop
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=r.min_tokens,
            ignore_eos=r.ignore_eos,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(r.stop_token_ids or ()),
            include_stop_str_in_output=r.include_stop_str_in_output,
            seed=r.seed,
        )

    def _new_request(
        self,
        req: Request,
        r: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        body: dict[str, Any],
    ) -> EngineRequest:
        params = self._sampling(r, len(prompt_ids))
        limit = self.cfg.max_model_len - len(prompt_ids)
        rid = req.headers.get("x-request-id")
        if not rid:
            # unique per process and across processes, without a urandom call per request
            self._num_ids += 1
            rid = f"{self._id_prefix}{self._num_ids:016x}"
        if rid in self.engine.requests:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        priority = self._priority(body)
        return EngineRequest(
            rid,
            prompt_ids,
            params,
            min(params.max_tokens, limit) if params.max_tokens is not None else limit,
            self.tokenizer.gen_ids,
            engine_seed=self.cfg.seed,
            fragments=self.tokenizer.gen_fragments if params.stop else None,
            priority=priority,
        )

    def _priority(self, body: dict[str, Any]) -> int:
        """vLLM's `priority` (an extra field of the validated body; lower is served first):
        refused unless the engine runs `--scheduling-policy priority`, with vLLM's words."""
        value = body.get("priority", 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise HttpError(400, "priority must be an integer", param="priority")
        if value != 0 and self.cfg.scheduling_policy != "priority":
            raise HttpError(
                400,
                f"Got priority {value} but Priority scheduling is not enabled.",
                param="priority",
            )
        return value

    async def _generate(
        self,
        req: Request,
        valid: ValidRequest[ChatCompletionRequest] | ValidRequest[CompletionRequest],
        prompt_ids: list[int],
        preloaded_tokens: int = 0,
        transfer_s: float = 0.0,
    ) -> Response | PushResponse:
        """Run one request; whatever way the handler ends (cancelled by a client that left
        before the response head included), the request leaves the engine."""
        chat = valid.chat
        # A chat reply starts without a space, unless it continues the assistant's message
        # (continue_final_message): then the first token follows the text already there, as
        # vLLM detokenizes it after the prompt, and a continued stream joins seamlessly.
        r = valid.request
        continues = isinstance(r, ChatCompletionRequest) and _continues_message(r)
        strip_first = chat and not continues
        ereq = self._new_request(req, valid.request, prompt_ids, valid.body)
        ereq.num_preloaded_tokens = preloaded_tokens
        stream = valid.stream
        headers = {"x-request-id": ereq.request_id}
        if transfer_s > 0:
            headers["x-flexpipe-kv-transfer-s"] = f"{transfer_s:.6f}"
            if self.cfg.time_scale > 0:
                await asyncio.sleep(transfer_s * self.cfg.time_scale)
        if stream:
            sse = SseStream(
                self.engine,
                ereq,
                chat,
                strip_first,
                valid.include_usage,
                valid.continuous_usage_stats,
                _now_s(),
                self._model_json,
                self.tokenizer.gen_fragments,
                self._frag_json,
                lambda r, upto: self._text(r, False, upto),
                self._usage,
            )
            ereq.sink = sse
            self.engine.add(ereq)
            return PushResponse(sse.start, headers=headers)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ereq.sink = FinishSink(done)
        self.engine.add(ereq)
        try:
            await done
        finally:
            # cancelled (the client left) or failed: abort frees its KV blocks and slot
            if ereq.is_finished:
                self.engine.release(ereq)
            else:
                self.engine.abort(ereq)
        if ereq.finish_reason == "error":
            raise HttpError(400, ereq.error or "request failed")
        text = self._text(ereq, strip_first, len(ereq.output_token_ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + ereq.request_id
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": ereq.finish_reason,
                "stop_reason": ereq.stop_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": ereq.finish_reason,
                "stop_reason": ereq.stop_reason,
                "prompt_logprobs": None,
            }
        return json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": _now_s(),
                "model": self.model_name,
                "choices": [choice],
                "usage": self._usage(ereq),
            },
            headers=headers,
        )

    @staticmethod
    def _usage(ereq: EngineRequest) -> dict[str, Any]:
        n_out = ereq.num_output_tokens
        return {
            "prompt_tokens": ereq.num_prompt_tokens,
            "total_tokens": ereq.num_prompt_tokens + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": {"cached_tokens": ereq.num_cached_tokens},
        }

    def _text(self, ereq: EngineRequest, strip: bool, upto: int) -> str:
        """The output text of the first `upto` output tokens (stop strings applied; `strip`:
        without the first token's leading space)."""
        frags = self.tokenizer.gen_fragments
        start = ereq.num_prompt_tokens
        text = "".join([frags.get(t, "") for t in ereq.token_ids[start : start + upto]])
        stop = ereq.stop_reason
        if isinstance(stop, str) and ereq.is_finished and upto >= ereq.num_output_tokens:
            idx = text.find(stop)
            if idx >= 0:
                text = (
                    text[: idx + len(stop)]
                    if ereq.params.include_stop_str_in_output
                    else text[:idx]
                )
        return text.lstrip(" ") if strip else text

    # --- migration hooks (admin) ---------------------------------------------------------
    async def admin_requests(self, req: Request) -> Response:
        self._check_admin(req)
        return json_response(
            {
                "requests": [
                    {
                        "request_id": r.request_id,
                        "status": r.status.value,
                        "num_prompt_tokens": r.num_prompt_tokens,
                        "num_output_tokens": r.num_output_tokens,
                        "num_computed_tokens": r.num_computed_tokens,
                    }
                    for r in self.engine.requests.values()
                ]
            }
        )

    async def admin_export(self, req: Request) -> Response:
        """An in-flight request's state; with "abort": true it also stops it here."""
        self._check_admin(req)
        body = self._json_object(req)
        rid = str(body.get("request_id", ""))
        for prefix in ("chatcmpl-", "cmpl-"):
            if rid.startswith(prefix) and rid not in self.engine.requests:
                rid = rid[len(prefix) :]
        ereq = self.engine.requests.get(rid)
        if ereq is None:
            raise HttpError(404, f"no in-flight request {rid!r}", "NotFoundError", "request_id")
        pm = self.cfg.pm
        num_kv = ereq.num_computed_tokens
        state: dict[str, Any] = {
            "request_id": ereq.request_id,
            "model": self.model_name,
            "status": ereq.status.value,
            "prompt_token_ids": ereq.prompt_token_ids,
            "output_token_ids": ereq.output_token_ids,
            "num_tokens": ereq.num_tokens,
            "num_kv_tokens": num_kv,
            "kv_bytes_per_token": pm.memory.kv_bytes_per_token,
            "kv_bytes": num_kv * pm.memory.kv_bytes_per_token,
            "recompute_s": pm.prefill_s(ereq.num_tokens) if ereq.num_tokens else 0.0,
            "max_tokens_left": ereq.max_output_tokens - ereq.num_output_tokens,
        }
        bandwidth = body.get("bandwidth_bytes_per_s")
        if bandwidth is not None:
            if (
                isinstance(bandwidth, bool)
                or not isinstance(bandwidth, int | float)
                or bandwidth <= 0
            ):
                raise HttpError(
                    400, "bandwidth_bytes_per_s must be > 0", param="bandwidth_bytes_per_s"
                )
            latency = _seconds(body, "latency_s")
            state["transfer_s"] = pm.kv_transfer_s(num_kv, float(bandwidth), latency)
        if body.get("abort"):
            self.engine.abort(ereq)
            state["aborted"] = True
        return json_response(state)

    async def admin_import(self, req: Request) -> Response | PushResponse:
        """Admit a request whose first `num_kv_tokens` tokens arrive as transferred KV.

        Body: a /v1/completions body (prompt as token ids: the original prompt followed by the
        tokens generated so far) plus "num_kv_tokens", "bandwidth_bytes_per_s" and optional
        "latency_s". The transfer time (the performance model's kv_transfer_s) is waited
        before admission; those tokens are then never computed."""
        self._check_admin(req)
        valid = self._valid(req, chat=False, strict_content_type=False)
        body = valid.body
        self._check_model(valid.model)
        self._check_ready()
        assert isinstance(valid.request, CompletionRequest)
        prompt_ids = self._completion_prompt(valid.request.prompt)
        num_kv = body.get("num_kv_tokens", 0)
        if type(num_kv) is not int or not 0 <= num_kv <= len(prompt_ids):
            raise HttpError(400, "num_kv_tokens must be in [0, len(prompt)]", param="num_kv_tokens")
        bandwidth = body.get("bandwidth_bytes_per_s")
        transfer_s = 0.0
        if num_kv:
            if (
                isinstance(bandwidth, bool)
                or not isinstance(bandwidth, int | float)
                or bandwidth <= 0
            ):
                raise HttpError(
                    400, "bandwidth_bytes_per_s must be > 0", param="bandwidth_bytes_per_s"
                )
            latency = _seconds(body, "latency_s")
            transfer_s = self.cfg.pm.kv_transfer_s(num_kv, float(bandwidth), latency)
        # the last token is always computed (its logits are needed)
        num_kv = min(num_kv, len(prompt_ids) - 1)
        return await self._generate(req, valid, prompt_ids, num_kv, transfer_s)


def _seconds(body: dict[str, Any], name: str) -> float:
    """An optional non-negative number of seconds from a JSON body (0 when absent)."""
    value = body.get(name)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
        raise HttpError(400, f"{name}: must be a number of seconds >= 0", param=name)
    return float(value)


def _secret_matches(given: str | None, secret: bytes) -> bool:
    """Constant-time comparison (no timing side channel on how much of a guess was right).
    Header values are latin-1 text of the bytes received: compare those bytes."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("latin-1", "replace"), secret)


def _bearer_matches(authorization: str | None, secret: bytes) -> bool:
    if authorization is None or not authorization.startswith("Bearer "):
        return False
    return _secret_matches(authorization[7:], secret)


__all__ = ["VLLM_COMPAT_VERSION", "SimServer"]


def _continues_message(req: ChatCompletionRequest) -> bool:
    """Whether the reply continues a non-empty final assistant message."""
    if not req.continue_final_message or req.messages[-1].role != "assistant":
        return False
    return bool(message_text(req.messages[-1].model_dump()["content"]))
