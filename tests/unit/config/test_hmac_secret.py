"""The HMAC secret check estimates entropy from repeats and runs, not from distinct characters
(issue 28: ``0123`` ten times and ``password`` four times passed the old check)."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.config.hmac_secret import MIN_SECRET_BITS, estimated_bits, literal_count, secret_problem
from kvguard.config.settings import Settings

WEAK = ["0123" * 10, "password" * 4, "k" * 40, "abcdefghijklmnopqrstuvwxyz0123456789",
        "0123456789abcdef0123456789abcdef", "qwertyqwertyqwertyqwertyqwertyqwerty", "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1",
        "aceg" * 9, "ZYXWVUTSRQPONMLKJIHGFEDCBAzyxwvuts"]


@pytest.mark.parametrize("secret", WEAK)
def test_patterned_secrets_of_32_bytes_and_more_are_refused_for_their_entropy(secret):
    assert len(secret.encode()) >= 32
    problem = secret_problem(secret)
    assert problem is not None and "bits of entropy" in problem, problem


@pytest.mark.parametrize("secret", WEAK[:2])
def test_the_policy_refuses_them_naming_the_field(secret):
    from kvguard.runtime.bootstrap import BootstrapError, bootstrap

    with pytest.raises(BootstrapError, match="policy.hmac_secret.*bits of entropy"):
        bootstrap(Settings.load(env={"KVGUARD_POLICY__HMAC_SECRET": secret}), predictor=None, require_secret=True)


@given(st.binary(min_size=16, max_size=64))
def test_random_keys_written_as_python_suggests_pass(raw):
    # docs and the error message suggest secrets.token_hex(32); any 16+ random bytes in hex pass too,
    # unless hypothesis hands over bytes that are themselves a pattern (runs or repeats)
    text = raw.hex()
    if literal_count(text) >= 0.8 * len(text):
        assert secret_problem(text) is None, (text, estimated_bits(text))


def test_the_generators_people_use_give_secrets_that_pass():
    for _ in range(200):
        for secret in (secrets.token_hex(32), secrets.token_urlsafe(32), secrets.token_hex(16)):
            assert secret_problem(secret) is None and estimated_bits(secret) >= MIN_SECRET_BITS, secret


def test_a_repeat_or_a_run_adds_about_nothing_to_the_estimate():
    # a "-" (no hex character, and more than a run's step from every one) keeps the parse of ``base``
    # itself unchanged: no repeat or run starting in it can reach across (greedy repeats otherwise can,
    # which made this test fail on one random base in a few hundred); the run uses letters no hex text
    # holds, so no repeat of ``base`` can take part of it (repeats are tried before runs)
    base = secrets.token_hex(20)
    assert literal_count(base + "-" + base) == literal_count(base) + 2  # the "-", then one repeat
    assert literal_count(base + "-ghijklmnopqrst") == literal_count(base) + 3  # "-", "g", "h"; the run is free
    assert estimated_bits("0123" * 10) < 16 and estimated_bits("password" * 4) < 48
