"""API keys without a network: loading (file, env, hashed lines), checking, key ids, and what never leaks."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

from shared import api_keys as api_keys_module
from shared.api_keys import ApiKeys, key_digest, key_id


def _key_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return str(path)


def test_file_keys_hashed_lines_and_env_keys_are_all_accepted(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"stored-hashed").hexdigest()
    file = _key_file(tmp_path, f"# team A\n\n  plain-key  \nsha256:{hashed.upper()}\n   # indented comment\n")
    keys = ApiKeys.load(file, env_keys=" env-1 , ,env-2")
    assert keys.is_enabled and len(keys.digests) == 4
    for key in ("plain-key", "stored-hashed", "env-1", "env-2"):
        assert keys.check(key) == key_id(key_digest(key))


def test_key_id_is_a_digest_prefix_identical_for_plain_and_hashed_entries(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"secret").hexdigest()
    from_hash = ApiKeys.load(_key_file(tmp_path, f"sha256:{hashed}\n"))
    from_plain = ApiKeys.from_keys(["secret"])
    assert from_hash.check("secret") == from_plain.check("secret") == hashed[:16]
    assert "secret" not in hashed[:16]


@pytest.mark.parametrize("presented", ["wrong", "", "secret ", "Secret", "secre"])
def test_wrong_keys_are_refused(presented: str) -> None:
    assert ApiKeys.from_keys(["secret"]).check(presented) is None


@pytest.mark.parametrize(("header", "accepted"), [
    ("Bearer secret", True), ("bearer secret", True), ("  Bearer   secret  ", True),
    ("Basic secret", False), ("secret", False), ("Bearer", False), ("Bearer ", False), ("", False),
    ("Bearer wrong", False), ("Bearer \udcff", False),
])
def test_authorization_needs_the_bearer_scheme(header: str, accepted: bool) -> None:
    assert (ApiKeys.from_keys(["secret"]).check_authorization(header) is not None) is accepted


def test_every_stored_digest_is_compared_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    compare = hmac.compare_digest

    def counting_compare(a: bytes, b: bytes) -> bool:
        calls.append(compare(a, b))
        return calls[-1]

    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", counting_compare)
    keys = ApiKeys.from_keys(["first", "second", "third"])
    assert keys.check("first") is not None
    assert calls == [True, False, False]  # no early exit: timing does not tell which key matched


def test_no_key_configured_means_authentication_is_off() -> None:
    keys = ApiKeys.load("", env_keys="")
    assert not keys.is_enabled and keys.check("anything") is None


def test_key_file_errors_name_the_flag_and_never_echo_the_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--api-key-file=.* cannot be read"):
        ApiKeys.load(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"--api-key-file=.* holds no key"):
        ApiKeys.load(_key_file(tmp_path, "# nothing here\n\n"))
    with pytest.raises(ValueError, match="line 2: sha256: must be followed by 64 hex digits") as info:
        ApiKeys.load(_key_file(tmp_path, "ok-key\nsha256:my-real-key-pasted-by-mistake\n"))
    assert "my-real-key" not in str(info.value)


def test_repr_shows_neither_keys_nor_digests() -> None:
    keys = ApiKeys.from_keys(["secret"])
    assert repr(keys) == "ApiKeys(num_keys=1)"
    assert key_digest("secret").hex() not in repr(keys) and "secret" not in repr(keys)
