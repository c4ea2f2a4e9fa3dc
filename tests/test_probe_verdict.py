"""The probe's verdict on hand-made replies: each leak signature raises its rule, an honest set raises none."""

from __future__ import annotations

from kvfence.audit.findings import Severity
from kvfence.audit.probe_verdict import Reply, ServerFacts, judge

FACTS = ServerFacts(context_length=1024, pool_tokens=4096)


def verdict(replies: list[Reply], base=(), after=(), replay=None, deterministic: bool = False) -> dict[str, Severity]:
    found = judge(
        replies,
        FACTS,
        list(base),
        list(after),
        replay,
        exact_counts=True,
        sized=True,
        expect_deterministic=deterministic,
    )
    return {f.rule: f.severity for f in found}


def golden(text: str) -> Reply:
    return Reply("golden-idle", 40, 200, text=text, prompt_tokens=40)


def test_an_honest_server_gets_no_warning_or_worse() -> None:
    replies = [
        Reply("boundary", 1023, 200, text="ok", prompt_tokens=1023),
        Reply("boundary", 1025, 400, error="too long"),
        Reply("canary", 50, 200, text="KVFAAAA", canary="KVFAAAA", prompt_tokens=50),
        Reply("canary", 60, 200, text="KVFBBBB", canary="KVFBBBB", prompt_tokens=60),
    ]
    base = [golden("one"), golden("two")]
    assert all(sev == Severity.INFO for sev in verdict(replies, base, base, base).values())


def test_the_placeholder_signature_and_an_over_length_200_are_critical() -> None:
    replies = [Reply("boundary", 1025, 200, text="?", prompt_tokens=1)]  # served from a 1-token stub
    got = verdict(replies)
    assert got["overlength-accepted"] == Severity.CRITICAL and got["prompt-tokens-mismatch"] == Severity.CRITICAL


def test_a_canary_in_another_requests_output_is_a_leak() -> None:
    replies = [
        Reply("canary", 50, 200, text="nothing", canary="KVFAAAA", prompt_tokens=50),
        Reply("golden-load", 40, 200, text="... KVFAAAA ...", prompt_tokens=40),
    ]
    assert verdict(replies)["canary-leak"] == Severity.CRITICAL


def test_golden_drift_after_churn_is_critical_only_for_a_deterministic_server() -> None:
    base, replay = [golden("the same answer")], [golden("the other answer")]
    assert verdict([], base, base, replay)["golden-drift-replay"] == Severity.WARNING
    assert verdict([], base, base, replay, deterministic=True)["golden-drift-replay"] == Severity.CRITICAL


def test_another_prompts_unique_text_in_a_reply_is_critical() -> None:
    churn = Reply("churn", 40, 200, text="ok", prompt_tokens=40, owner="churn 0", markers=("a1b2 c3d4 e5f6",))
    replay = Reply("golden-replay", 40, 200, text="blue a1b2 c3d4 e5f6", prompt_tokens=40, owner="golden 0")
    own = Reply("churn", 40, 200, text="a1b2 c3d4 e5f6", prompt_tokens=40, owner="churn 0", markers=("a1b2 c3d4 e5f6",))
    assert verdict([churn, replay])["foreign-text-echo"] == Severity.CRITICAL
    assert "foreign-text-echo" not in verdict([churn, own])  # a reply may repeat its own prompt


def test_limits_name_what_the_run_could_not_establish() -> None:
    from kvfence.audit.probe_verdict import limits

    replies = [Reply("golden-idle", 40, 200, text="a b", prompt_tokens=40)]
    got = {x.check: x.why for x in limits(replies, FACTS, sized=True, exact_counts=False, expect_deterministic=True,
                                          churn=1)}  # fmt: skip
    assert "page reuse not established" in got["golden-replay"] and "4096" in got["golden-replay"]
    assert "usage.prompt_tokens" in got["prompt-tokens"] and "canary" in got and "golden" not in got
    small = ServerFacts(context_length=1024, pool_tokens=10)
    got = {x.check for x in limits(replies, small, sized=True, exact_counts=True, expect_deterministic=True, churn=1)}
    assert "golden-replay" not in got and "prompt-tokens" not in got
