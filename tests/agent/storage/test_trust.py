"""The trusted-keys folder and the device's secrets are checked on disk before use
(agent/storage/trust.py); each refusal names the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.storage.trust import check_secret_file, check_trusted_dir, load_trusted
from registry.errors import KeyFileError
from registry.signing import generate_keypair


@pytest.fixture
def trusted(tmp_path: Path) -> Path:
    _, pub = generate_keypair(tmp_path / "keys", "upstream", ["digits"])
    folder = tmp_path / "trusted"
    folder.mkdir()
    (folder / pub.name).write_bytes(pub.read_bytes())
    (folder / "upstream.scope").write_bytes((tmp_path / "keys/upstream.scope").read_bytes())
    return folder


def test_a_clean_folder_loads(trusted: Path) -> None:
    keys = load_trusted(trusted)
    assert [k.name for k in keys.values()] == ["upstream"]
    assert check_trusted_dir(trusted) == [trusted / "upstream.pub.pem"]


@pytest.mark.parametrize(("spoil", "blamed", "why"), [
    (lambda d: (d / "upstream.pub.pem").chmod(0o666), "upstream.pub.pem", "writable by group"),
    (lambda d: (d / "upstream.scope").chmod(0o620), "upstream.scope", "writable by group"),
    (lambda d: d.chmod(0o775), "", "writable by group"),
    (lambda d: (d / "x.pub.pem").write_bytes((d / "upstream.pub.pem").read_bytes() * 2),
     "x.pub.pem", "not exactly one PEM public key"),
    (lambda d: (d / "x.pub.pem").write_bytes(b"registry=http://a?k=" +
                                             (d / "upstream.pub.pem").read_bytes()),
     "x.pub.pem", "not exactly one PEM public key"),
    (lambda d: (d / "x.pub.pem").symlink_to(d / "upstream.pub.pem"), "x.pub.pem",
     "not a regular file"),
    (lambda d: (d / "notes.txt").write_text("hi"), "notes.txt", "does not belong"),
    (lambda d: (d / "big.pub.pem").write_bytes(b"x" * 5000), "big.pub.pem", "bytes"),
])
def test_anything_else_is_refused_naming_the_file(trusted: Path, spoil, blamed: str,
                                                  why: str) -> None:
    spoil(trusted)
    with pytest.raises(KeyFileError, match=why) as e:
        load_trusted(trusted)
    assert str(trusted / blamed).rstrip("/") in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_key_owned_by_someone_else_is_refused(trusted: Path) -> None:
    os.chown(trusted / "upstream.pub.pem", 4242, 4242)
    with pytest.raises(KeyFileError, match="owned by uid 4242"):
        load_trusted(trusted)


def test_a_single_file_or_a_missing_folder_is_refused(trusted: Path, tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="is not a folder"):
        load_trusted(trusted / "upstream.pub.pem")
    with pytest.raises(KeyFileError, match="No such file"):
        load_trusted(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KeyFileError, match=r"no \*\.pub\.pem public keys"):
        load_trusted(empty)


def test_secrets_must_be_private(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("s3cret\n")
    f.chmod(0o600)
    check_secret_file(f, "mqtt.password_file")
    for mode in (0o640, 0o604, 0o660):
        f.chmod(mode)
        with pytest.raises(KeyFileError, match=f"mqtt.password_file {f} is open to group"):
            check_secret_file(f, "mqtt.password_file")
