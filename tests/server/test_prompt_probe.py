"""A tenant probing for another tenant's prompt learns nothing from the response.

Injected: the attack found on the old server. A victim's memo naming a company is stored (tenant
alice). An attacker guesses the company, sending the memo with the right and with a wrong name, with
``store_prompt=false`` (leaving no trace) and share settings that accept any reference
(``min_match_rate=0``, ``min_similarity=0``, ``min_aligned_after_prefix=0``), and reads every stat the
response has (the server runs with ``debug_stats``: the worst case). On the old server the right guess
gave a longer exact prefix and more reused tokens (share_exact_prefix 70 vs 61, reused 64 vs 48 on
SmolLM2), and share_reference named the victim's prompt key.

Must hold: as another tenant (bob), or as the victim's tenant with another cache salt, the right and
the wrong guess get the same answer in every stat but timings — a full prefill, nothing reused, no
share reference; while the same probe *inside* the victim's namespace does tell them apart (a control:
the probe is sensitive, so the equality above is isolation, not a blunt probe). Without
``debug_stats`` (the default) a response says how many of its prompt tokens were reused (a count, as
OpenAI's ``cached_tokens``: inside one namespace the guesses may differ there) and no other stat of reuse.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig
from semkv.server.app import PUBLIC_STATS
from semkv.server.auth import APIKeys

TINY = "tiny"
KEYS = {"alice": "sk-alice-0123456789abcdef", "bob": "sk-bob-0123456789abcdef"}
MEMO = (
    "Confidential memo. {company} will announce the acquisition of its largest competitor on Monday; "
    "the board approved the price and the layoffs of twelve percent of the staff in the third quarter. "
    "Do not share this memo outside the executive team under any circumstances."
)
RIGHT, WRONG = "Acme Robotics", "Zenith Motors"
PROBE = {
    "store_prompt": False,
    "share": {"min_match_rate": 0.0, "min_similarity": 0.0, "min_aligned_after_prefix": 0},
}
TIMINGS = {
    "ttft_s",
    "decode_s",
    "decode_ms_per_token",
    "server_ttft_s",
    "store_s",
    "share_lookup_ms",
    "share_match_ms",
}


def is_timing(name: str) -> bool:
    """Timings differ between any two requests (every ``*_s`` / ``*_ms`` stat, e.g. prefill_summarise_s)."""
    return name in TIMINGS or name.endswith(("_s", "_ms"))


def ask(client, tenant: str, company: str, **extra) -> dict:
    body = {"model": TINY, "prompt": MEMO.format(company=company), "max_tokens": 1, "semkv": PROBE, **extra}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    r = client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json()["semkv"].items() if not is_timing(k)}


@pytest.fixture
def victim_stored(tiny_app):
    keys = APIKeys.parse("\n".join(f"{key} {tenant}" for tenant, key in KEYS.items()))
    with TestClient(
        tiny_app(ServerConfig(api_keys=keys, debug_stats=True)), raise_server_exceptions=False
    ) as c:
        stored = c.post(
            "/v1/completions",
            json={"model": TINY, "prompt": MEMO.format(company=RIGHT), "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
        )
        assert stored.status_code == 200 and stored.json()["semkv"]["prompt_tokens"] >= 64
        yield c


def test_the_probe_tells_guesses_apart_inside_the_victims_namespace(victim_stored):
    """The control: the probe is sensitive where reuse is allowed."""
    right, wrong = ask(victim_stored, "alice", RIGHT), ask(victim_stored, "alice", WRONG)
    assert right["reused_tokens"] > wrong["reused_tokens"] > 0, (right, wrong)


@pytest.mark.parametrize("attacker", ["other_tenant", "same_tenant_other_salt"])
def test_another_namespace_learns_nothing(victim_stored, attacker):
    tenant, extra = ("bob", {}) if attacker == "other_tenant" else ("alice", {"cache_salt": "attacker"})
    right, wrong = ask(victim_stored, tenant, RIGHT, **extra), ask(victim_stored, tenant, WRONG, **extra)
    assert right["path"] == wrong["path"] == "full" and right["reused_tokens"] == wrong["reused_tokens"] == 0
    assert not any(k.startswith("share_") for k in right), right
    assert right["refused"] == wrong["refused"]
    assert {k: v for k, v in right.items()} == {k: v for k, v in wrong.items()}, (right, wrong)


def test_default_server_returns_no_reuse_stats(tiny_app):
    with TestClient(tiny_app(ServerConfig()), raise_server_exceptions=False) as c:
        c.post("/v1/completions", json={"model": TINY, "prompt": MEMO.format(company=RIGHT), "max_tokens": 1})
        answers = []
        for company in (RIGHT, WRONG):
            body = {"model": TINY, "prompt": MEMO.format(company=company), "max_tokens": 1, "semkv": PROBE}
            response = c.post("/v1/completions", json=body).json()
            stats = response["semkv"]
            assert set(stats) <= PUBLIC_STATS, stats
            assert stats["reused_tokens"] == response["usage"]["prompt_tokens_details"]["cached_tokens"]
            answers.append({k: v for k, v in stats.items() if not is_timing(k) and k != "reused_tokens"})
        assert answers[0] == answers[1]
