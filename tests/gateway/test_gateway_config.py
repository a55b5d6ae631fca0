"""The gateway's configuration file: a number that is not finite (YAML `.inf`, `.nan`) is a
ConfigError naming its field, never a limit or timeout that does not hold."""

from __future__ import annotations

import pytest
import yaml

from flexpipe.gateway.config import ConfigError, config_from_dict


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("max_queue_wait_s: .inf", "gateway config.max_queue_wait_s"),
        ("http: {max_body_bytes: .nan}", "http.max_body_bytes"),
        ("tenants: [{key: k, requests_per_min: .inf}]", "tenants[0].requests_per_min"),
        ("backends: [{url: 'http://127.0.0.1:9', weight: .inf}]", "backends[0].weight"),
        ("routing: {params: {imbalance_ratio: .nan}}", "routing.params.imbalance_ratio"),
    ],
)
def test_an_infinite_number_is_an_error_naming_its_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(yaml.safe_load(text))
    assert str(info.value).startswith(f"{field}: expected a finite number, got ")


def test_finite_numbers_still_load() -> None:
    cfg = config_from_dict(yaml.safe_load("tenants: [{key: k, requests_per_min: 60.5}]"))
    assert cfg.tenants[0].requests_per_min == 60.5
