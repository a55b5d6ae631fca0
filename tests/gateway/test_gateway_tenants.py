"""A tenant's limits, exactly (flexpipe/gateway/tenants.py): the clock is held (`now` fixed,
or the buckets' refill stopped), so every level is an exact number."""

from __future__ import annotations

import openai
import pytest
from test_gateway_api import Running
from test_gateway_exits import idle, wait_for
from test_gateway_fakes import FakeEngine, LoopThread

from flexpipe.gateway.config import TenantConfig
from flexpipe.gateway.tenants import Tenant


def test_a_request_refused_for_tokens_spends_no_request_slot() -> None:
    """A tenant with both limits: 3 requests and 200 tokens a minute, at one instant. Each
    refusal for tokens gives its request slot back, so the three slots serve three
    requests, however many were refused for tokens in between."""
    t = Tenant(TenantConfig("k", "t", requests_per_min=3, tokens_per_min=200), 0.0)
    assert t.requests is not None and t.tokens is not None
    assert t.admit(150, 0.0) == (True, 0.0, "")
    assert (t.requests.level, t.tokens.level) == (2.0, 50.0)
    # 100 tokens with 50 left: 50 more at 200/60 a second
    assert t.admit(100, 0.0) == (False, 15.0, "tokens per minute exceeded")
    assert (t.requests.level, t.tokens.level) == (2.0, 50.0)
    assert t.admit(60, 0.0) == (False, 3.0, "tokens per minute exceeded")
    assert t.admit(50, 0.0) == (True, 0.0, "")
    assert (t.requests.level, t.tokens.level) == (1.0, 0.0)
    t.settle(150, 110, 0.0)  # the first used 40 fewer than it was charged
    assert t.tokens.level == 40.0
    assert t.admit(41, 0.0) == (False, pytest.approx(0.3), "tokens per minute exceeded")
    assert t.admit(40, 0.0) == (True, 0.0, "")
    assert (t.requests.level, t.tokens.level) == (0.0, 0.0)
    # the slots are spent by the three admitted, none by the three refused: 1 at 3/60 a s
    assert t.admit(0, 0.0) == (False, 20.0, "requests per minute exceeded")


def test_a_tenant_is_charged_its_prompt_and_its_output_exactly(lt: LoopThread) -> None:
    """The token budget settles each request at what it used: its prompt (as the gateway
    counts it: 400 bytes are 101 tokens) and its output (the usage the engine reported, or
    the tokens a stream relayed). With one-token prompts a settlement that forgot the
    prompt differed by one token a request."""
    tenants = [{"key": "sk-t", "name": "t", "tokens_per_min": 6000}]
    r = Running(lt, [FakeEngine()], tenants=tenants)
    try:
        bucket = r.gw.tenants.lookup("Bearer sk-t").tokens  # type: ignore[union-attr]
        assert bucket is not None
        # no refill (it refills only after its last update): the level moves only by charges
        # and settlements
        bucket.updated_s = float("inf")
        client = r.client("sk-t")
        out = client.completions.create(model="fake-model", prompt="x" * 400, max_tokens=20)
        assert out.usage is not None and out.usage.completion_tokens == 20
        wait_for(lambda: idle(r), 5)
        assert bucket.level == 6000 - (101 + 20)
        stream = client.completions.create(
            model="fake-model", prompt="y" * 800, max_tokens=30, stream=True
        )
        assert len([c for c in stream if c.choices]) == 30
        wait_for(lambda: idle(r), 5)
        assert bucket.level == 6000 - (101 + 20) - (201 + 30)
        # a chat stream with its usage chunk: "<user>" and 394 bytes are 101 tokens
        chat = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "c" * 394}],
            max_tokens=10, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        assert len([c for c in chat if c.choices]) == 11  # the role's event, ten tokens
        wait_for(lambda: idle(r), 5)
        assert bucket.level == 6000 - 121 - 231 - (101 + 10)
        # estimated at admission (prompt + max_tokens): 5576 + 1 tokens do not fit in 5537
        with pytest.raises(openai.RateLimitError, match="tokens per minute"):
            client.completions.create(model="fake-model", prompt="z" * 22300, max_tokens=1)
        assert bucket.level == 6000 - 121 - 231 - 111
    finally:
        r.close()
