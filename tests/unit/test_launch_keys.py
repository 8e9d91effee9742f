"""Launches are keyed by default: `kvbridge demo` makes a fresh deployment key in a private temporary file and
removes it; `kvbridge serve` uses this user's key file (created once, owner-only) unless told otherwise; running
without a key takes an explicit --keyless-exposes-kv-to-local-processes and says so loudly. No vLLM is started here
(test_demo.py and test_proxy.py run the real commands)."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from kvbridge.core.errors import ConfigError
from kvbridge.core.topology import ParallelLayout
from kvbridge.serving import demo, serve
from kvbridge.serving.launcher import (
    INSECURE_WARNING,
    default_key_file,
    ensure_key_file,
    key_file_warning,
    private_key_file,
)
from kvbridge.wire.keys import load_keys, read_key_file


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_private_key_file_is_owner_only_random_and_removed_afterwards():
    with private_key_file() as first, private_key_file() as second:
        assert mode(first) == 0o600 and mode(first.parent) == 0o700
        assert read_key_file(str(first)) != read_key_file(str(second))  # a fresh key each time
        assert len(read_key_file(str(first))) == 64 and load_keys(None, str(first)) is not None
    assert not first.parent.exists() and not second.parent.exists()
    with pytest.raises(KeyboardInterrupt), private_key_file() as third:
        raise KeyboardInterrupt
    assert not third.parent.exists(), "removed on Ctrl-C too"


def test_a_given_key_file_is_used_as_it_is_and_kept(tmp_path):
    given = tmp_path / "k"
    given.write_text("x" * 32)
    with private_key_file(given) as path:
        assert path == given
    assert given.read_text() == "x" * 32


def test_a_key_file_is_created_once_then_reused(tmp_path):
    path, created = ensure_key_file(tmp_path / "new" / "deployment.key")
    assert created and mode(path) == 0o600 and mode(path.parent) == 0o700
    key = path.read_bytes()
    again, created = ensure_key_file(path)
    assert again == path and not created and path.read_bytes() == key


def test_a_key_file_others_can_read_is_warned_about(tmp_path):
    path, _ = ensure_key_file(tmp_path / "k")
    assert key_file_warning(path) is None
    path.chmod(0o644)  # the negative control: the same check notices a readable file
    assert "readable by others" in key_file_warning(path)


def demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_demo_servers_get_the_key_and_without_it_nothing(tmp_path):
    layout = ParallelLayout.parse("pp=1,tp=1")
    keyed = demo._server("p", tmp_path, layout, 0, tmp_path, tmp_path / "key")
    assert keyed.kv_transfer_config["kv_connector_extra_config"]["auth_key_file"] == str(tmp_path / "key")
    keyless = demo._server("p", tmp_path, layout, 0, tmp_path, None)
    assert "auth_key_file" not in keyless.kv_transfer_config["kv_connector_extra_config"]


def test_the_demo_uses_a_private_key_unless_told_otherwise(monkeypatch, capsys, tmp_path):
    seen = []
    monkeypatch.setattr(demo, "_run", lambda args, key_file: seen.append(key_file) or 0)
    assert demo.run(demo_args()) == 0
    (made,) = seen
    assert made.name == "deployment.key" and not made.exists(), "the fresh key is removed at the end"
    assert "a fresh random key, removed at the end" in capsys.readouterr().out
    given = tmp_path / "given"
    given.write_text("g" * 32)
    assert demo.run(demo_args("--auth-key-file", str(given))) == 0 and seen[-1] == given and given.exists()
    assert demo.run(demo_args("--keyless-exposes-kv-to-local-processes")) == 0 and seen[-1] is None
    assert INSECURE_WARNING in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo_args("--keyless-exposes-kv-to-local-processes", "--auth-key-file", str(given))


def serve_spec(*argv: str) -> serve.ServeSpec:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return serve.spec_from_args(parser.parse_args(["--role", "decode", "--model", "m", "--platform", "cpu", *argv]))


def extra(spec: serve.ServeSpec) -> dict:
    return spec.kv_transfer_config()["kv_connector_extra_config"]


def test_serve_uses_the_users_key_file_by_default(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    spec = serve_spec()
    assert extra(spec)["auth_key_file"] == str(default_key_file()) == str(tmp_path / "kvbridge" / "deployment.key")
    serve._announce_key(spec)  # what `run` does before it starts vLLM
    assert mode(default_key_file()) == 0o600 and "created with a fresh random key" in capsys.readouterr().out
    key = default_key_file().read_bytes()
    serve._announce_key(serve_spec())  # a second server started on this machine gets the same key
    assert default_key_file().read_bytes() == key and "(existing)" in capsys.readouterr().out


def test_serve_takes_a_named_key_file_only_if_it_exists(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    named = tmp_path / "deploy.key"
    with pytest.raises(ConfigError, match="does not exist"):
        serve_spec("--auth-key-file", str(named))  # a typo must not make a second key
    named.write_text("n" * 32)
    assert extra(serve_spec("--auth-key-file", str(named)))["auth_key_file"] == str(named)
    assert extra(serve_spec("--kv-extra", f"auth_key_file={named}"))["auth_key_file"] == str(named)
    with pytest.raises(ConfigError, match="not both"):
        serve_spec("--auth-key-file", str(named), "--kv-extra", f"auth_key_file={named}")
    assert not (tmp_path / "config").exists()


def test_serve_without_a_key_must_be_asked_for_and_warns_loudly(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    spec = serve_spec("--keyless-exposes-kv-to-local-processes")
    assert "auth_key_file" not in extra(spec) and "auth_key" not in extra(spec)
    serve._announce_key(spec)
    assert INSECURE_WARNING in capsys.readouterr().err
    assert not (tmp_path / "kvbridge").exists()


def test_serve_refuses_a_keyless_side_channel_beyond_loopback_up_front(monkeypatch, tmp_path):
    """`kvbridge serve --keyless-exposes-kv-to-local-processes --kv-extra side_channel_host=0.0.0.0` is refused by
    the spec itself, not only once vLLM loads the connector (which would print a command that cannot work): it
    refuses, dry-run included, for the roles that serve a side channel; the controls: with a key, on loopback, or as
    a decode it is accepted."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    wide = ("--kv-extra", "side_channel_host=0.0.0.0")
    for role in ("prefill", "both"):
        with pytest.raises(ConfigError, match="not a loopback address"):
            serve_spec("--role", role, "--keyless-exposes-kv-to-local-processes", *wide)
    serve_spec("--role", "decode", "--keyless-exposes-kv-to-local-processes", *wide)
    serve_spec("--role", "prefill", "--keyless-exposes-kv-to-local-processes")
    serve_spec("--role", "prefill", *wide)  # the user's key file


def test_serve_recomputes_failed_loads_by_default_and_a_flag_keeps_fail(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert serve_spec().kv_transfer_config()["kv_load_failure_policy"] == "recompute"
    spec = serve_spec("--kv-load-failure-policy", "fail")
    assert spec.kv_transfer_config()["kv_load_failure_policy"] == "fail"


def test_the_demo_servers_recompute_failed_loads(tmp_path):
    server = demo._server("p", tmp_path, ParallelLayout.parse("pp=1,tp=1"), 0, tmp_path, None)
    assert server.kv_transfer_config["kv_load_failure_policy"] == "recompute"
