"""``patches/sglang-0.5.23`` and the applier (``make apply-patches`` / ``revert-patches``).

Everything works on copies in temporary directories; the venv's SGLang is only read, and
it may be patched (``make apply-patches && make test``): each copy has the patches
reverted and is then checked against the wheel's ``.dist-info/RECORD`` (sha256)
(``pristine_copy``), so the copies are pristine copies of the pinned wheel:

- most tests use a small copy (the package's top files and ``srt/server_args.py``, the
  only file the patches touch);
- one test copies the whole package once (~220 MB, a few seconds), applies the patches,
  runs ``python -m sglang.launch_server --help`` and builds ``ServerArgs`` from the
  ``--storage-*`` flags in subprocesses that import the patched copy, then reverts and
  checks that every file is byte-identical again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sglang_storage_adapters import SUPPORTED_SGLANG_VERSION
from sglang_storage_adapters.patching import (
    PatchConflictError,
    PatchState,
    PatchTargetError,
    SGLangTree,
    apply_patches,
    load_patches,
    locate_sglang,
    main,
    patch_states,
    pristine_copy,
    record_mismatches,
    revert_patches,
)

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
PATCHES_DIR = ROOT / "patches" / f"sglang-{SUPPORTED_SGLANG_VERSION}"
PATCHED_FILE = "srt/server_args.py"
ENCODER_FILE = "srt/disaggregation/encoder/server.py"
PATCHED_FILES = (PATCHED_FILE, ENCODER_FILE)
SMALL_COPY = ("__init__.py", "_version.py", "version.py", *PATCHED_FILES)
# Subprocesses import the copies without writing __pycache__ into them.
QUIET_ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def installed() -> SGLangTree:
    """The venv's SGLang, patched or not (only read)."""
    tree = locate_sglang()
    assert record_mismatches(tree, SMALL_COPY) is not None, (
        f"{tree.package_dir} has no .dist-info/RECORD to check copies against"
    )
    return tree


@pytest.fixture
def small(installed: SGLangTree, tmp_path: Path) -> Path:
    """A pristine small copy: ``<tmp>/sglang`` with the files the patches need."""
    patches = load_patches(PATCHES_DIR)
    return pristine_copy(installed, tmp_path / "sglang", patches, SMALL_COPY).package_dir


def test_pristine_copy_of_a_patched_tree_is_the_wheel(small: Path, tmp_path: Path) -> None:
    """What ``make apply-patches`` leaves in the venv still gives pristine copies."""
    patches = load_patches(PATCHES_DIR)
    tree = locate_sglang(small)
    pristine = _snapshot(small)
    apply_patches(tree, patches)  # the venv after `make apply-patches`, in small
    installed = locate_sglang()
    dist_info = next(installed.package_dir.parent.glob("sglang-*.dist-info"))
    (small.parent / dist_info.name).mkdir()
    shutil.copy2(dist_info / "RECORD", small.parent / dist_info.name / "RECORD")
    copy = pristine_copy(tree, tmp_path / "copy" / "sglang", patches, SMALL_COPY)
    assert _snapshot(copy.package_dir) == pristine
    assert patch_states(copy, patches) == [PatchState.NOT_APPLIED] * len(patches)


def test_pristine_copy_refuses_a_file_edited_otherwise(small: Path, tmp_path: Path) -> None:
    installed = locate_sglang()
    dist_info = next(installed.package_dir.parent.glob("sglang-*.dist-info"))
    (small.parent / dist_info.name).mkdir()
    shutil.copy2(dist_info / "RECORD", small.parent / dist_info.name / "RECORD")
    with (small / "version.py").open("a") as edited:
        edited.write("# edited\n")
    with pytest.raises(PatchTargetError, match=r"version\.py"):
        pristine_copy(locate_sglang(small), tmp_path / "copy" / "sglang", [], SMALL_COPY)


def _snapshot(root: Path) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_storage_adapters.patching", *args],
        capture_output=True,
        text=True,
        check=False,
        env=QUIET_ENV,
    )


# ---------------------------------------------------------------------------- the patches


def test_patches_are_small_and_only_wire() -> None:
    patches = load_patches(PATCHES_DIR)
    names = [patch.name for patch in patches]
    assert names == sorted(names)
    assert all(name[:4].isdigit() and name[4] == "-" for name in names)
    added = [
        line
        for patch in patches
        for section in patch.files
        for hunk in section.hunks
        for line in hunk.new_lines
        if line not in hunk.old_lines
    ]
    assert sum(patch.hunk_count for patch in patches) <= 5
    assert len(added) <= 20
    # Every added line is a comment, a blank, or an import of / call into an adapter module.
    wiring = (
        "from sglang_storage_adapters.flags import ",
        "add_storage_cli_args(parser)",
        "args = apply_storage_args(args)",
        "raw_args = apply_storage_args(raw_args, parser)",
        "from sglang_storage_adapters.embedding import install",
        "install()",
    )
    for line in added:
        text = line.decode().strip()
        assert not text or text.startswith("#") or text.startswith(wiring), text
    assert {section.path for patch in patches for section in patch.files} == set(PATCHED_FILES)


# ---------------------------------------------------------------------------- apply / revert


def test_apply_is_idempotent_and_revert_restores_every_byte(small: Path) -> None:
    patches = load_patches(PATCHES_DIR)
    pristine = _snapshot(small)
    tree = locate_sglang(small)
    assert patch_states(tree, patches) == [PatchState.NOT_APPLIED] * len(patches)

    first = apply_patches(tree, patches)
    assert first.changed == tuple(p.name for p in patches)
    assert set(first.files) == {small / name for name in PATCHED_FILES}
    patched = _snapshot(small)
    assert patched != pristine
    assert patch_states(tree, patches) == [PatchState.APPLIED] * len(patches)

    again = apply_patches(tree, patches)
    assert (again.changed, again.unchanged, again.files) == ((), first.changed, ())
    assert _snapshot(small) == patched

    reverted = revert_patches(tree, patches)
    assert set(reverted.changed) == set(first.changed)
    assert _snapshot(small) == pristine  # byte-identical, and no temp file left behind
    assert revert_patches(tree, patches).changed == ()


def test_a_partly_applied_series_is_completed(small: Path) -> None:
    patches = load_patches(PATCHES_DIR)
    tree = locate_sglang(small)
    apply_patches(tree, patches[:1])
    assert patch_states(tree, patches) == [
        PatchState.APPLIED,
        *[PatchState.NOT_APPLIED] * (len(patches) - 1),
    ]
    outcome = apply_patches(tree, patches)
    assert outcome.unchanged == (patches[0].name,)
    assert outcome.changed == tuple(patch.name for patch in patches[1:])


def test_a_patch_that_does_not_apply_names_file_and_hunk_and_changes_nothing(
    small: Path,
) -> None:
    target = small / PATCHED_FILE
    text = target.read_text()
    line = "    raw_args = parser.parse_args(argv)\n"
    assert text.count(line) == 1
    target.write_text(text.replace(line, "    raw_args = parser.parse_args(argv or [])\n"))
    before = _snapshot(small)

    with pytest.raises(PatchConflictError) as caught:
        apply_patches(locate_sglang(small), load_patches(PATCHES_DIR))
    message = str(caught.value)
    assert "0002-storage-flags-to-hicache.patch" in message
    assert f"hunk #2 of {PATCHED_FILE}" in message
    assert "raw_args = parser.parse_args(argv)" in message  # the line the hunk expects
    assert "left unchanged" in message
    # 0001 fits, but nothing is written when any patch does not.
    assert _snapshot(small) == before

    result = _cli("apply", "--sglang-dir", str(small), "--patches-dir", str(PATCHES_DIR))
    assert result.returncode == 1
    assert "0002-storage-flags-to-hicache.patch: hunk #2" in result.stderr
    assert _snapshot(small) == before


def test_another_release_is_refused(small: Path) -> None:
    version_file = small / "_version.py"
    version_file.write_text(version_file.read_text().replace("0.5.23", "0.5.22"))
    before = _snapshot(small)
    with pytest.raises(PatchTargetError) as caught:
        locate_sglang(small)
    message = str(caught.value)
    assert "is SGLang 0.5.22" in message
    assert str(version_file) in message
    assert f"for SGLang {SUPPORTED_SGLANG_VERSION}" in message
    result = _cli("apply", "--sglang-dir", str(small), "--patches-dir", str(PATCHES_DIR))
    assert result.returncode == 1
    assert "0.5.22" in result.stderr
    assert _snapshot(small) == before


def test_a_directory_that_is_not_sglang_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PatchTargetError, match="neither an sglang package directory"):
        locate_sglang(tmp_path)


def test_a_git_checkout_works_and_its_version_can_come_from_the_tag(
    installed: SGLangTree, tmp_path: Path
) -> None:
    patches = load_patches(PATCHES_DIR)
    package_dir = pristine_copy(
        installed, tmp_path / "python" / "sglang", patches, SMALL_COPY
    ).package_dir
    tree = locate_sglang(tmp_path)
    assert (tree.package_dir, tree.kind) == (package_dir, "git checkout")

    # A checkout that was never built has no _version.py: the tag at HEAD names the release.
    (package_dir / "_version.py").unlink()
    git = tmp_path / ".git"
    (git / "refs" / "tags").mkdir(parents=True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    (git / "HEAD").write_text(f"{commit}\n")
    (git / "refs" / "tags" / f"v{SUPPORTED_SGLANG_VERSION}").write_text(f"{commit}\n")
    tree = locate_sglang(tmp_path)
    assert tree.version == SUPPORTED_SGLANG_VERSION
    assert tree.version_source == f"git tag v{SUPPORTED_SGLANG_VERSION} at HEAD"

    pristine = _snapshot(package_dir)
    args = ("--sglang-dir", str(tmp_path), "--patches-dir", str(PATCHES_DIR))
    applied = _cli("apply", *args)
    assert applied.returncode == 0, applied.stderr
    count = len(load_patches(PATCHES_DIR))
    assert f"applied {count} of {count} patches" in applied.stdout
    again = _cli("apply", *args)
    assert again.returncode == 0, again.stderr
    assert "already applied" in again.stdout
    status = _cli("status", *args)
    assert "0001-add-storage-flag-group.patch: applied" in status.stdout
    reverted = _cli("revert", *args)
    assert reverted.returncode == 0, reverted.stderr
    assert _snapshot(package_dir) == pristine


def test_make_targets_patch_sglang_dir(small: Path) -> None:
    pristine = _snapshot(small)
    # -o: treat the venv stamp as up to date, so make never reinstalls from a test.
    make = ["make", "--no-print-directory", "-o", ".venv/.installed", "-C", str(ROOT)]
    applied = subprocess.run(
        [*make, "apply-patches", f"SGLANG_DIR={small}"],
        capture_output=True,
        text=True,
        check=False,
        env=QUIET_ENV,
    )
    assert applied.returncode == 0, applied.stderr
    assert _snapshot(small) != pristine
    reverted = subprocess.run(
        [*make, "revert-patches", f"SGLANG_DIR={small}"],
        capture_output=True,
        text=True,
        check=False,
        env=QUIET_ENV,
    )
    assert reverted.returncode == 0, reverted.stderr
    assert _snapshot(small) == pristine


def test_status_of_the_venv_is_read_only(installed: SGLangTree) -> None:
    before = {name: (installed.package_dir / name).read_bytes() for name in PATCHED_FILES}
    states = patch_states(installed, load_patches(PATCHES_DIR))  # patched or not
    result = _cli("status", "--patches-dir", str(PATCHES_DIR))
    assert result.returncode == 0, result.stderr
    assert f"SGLang {SUPPORTED_SGLANG_VERSION} at {installed.package_dir}" in result.stdout
    applied = result.stdout.count(" applied") - result.stdout.count("not applied")
    assert applied == states.count(PatchState.APPLIED)
    assert main(["status", "--patches-dir", str(PATCHES_DIR)]) == 0
    assert {name: (installed.package_dir / name).read_bytes() for name in PATCHED_FILES} == before


# ---------------------------------------------------------------------------- the patched server

SERVER_ARGS_PROBE = textwrap.dedent(
    """
    import argparse, contextlib, io, json, sys
    import msgspec
    import sglang.srt.server_args as module
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    root = sys.argv[1]
    fields = ["enable_hierarchical_cache", "hicache_storage_backend",
              "hicache_storage_backend_extra_config", "hicache_size",
              "hicache_write_policy", "hicache_storage_prefetch_policy"]
    out = {"module": module.__file__}
    good = prepare_server_args([
        "--model-path", "m", "--storage-backend", "file",
        "--storage-backend-config", json.dumps({"root": root}),
        "--storage-host-memory", "64GiB", "--storage-write-policy", "write_back",
        "--storage-prefetch-policy", "wait_complete", "--storage-managers", "kv"])
    out["good"] = {name: getattr(good, name) for name in fields}

    def usage_error(argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                prepare_server_args(["--model-path", "m", *argv])
            except SystemExit as exit:
                return [exit.code, err.getvalue().strip().splitlines()[-1]]
        return None

    out["bad"] = [usage_error(argv) for argv in (
        ["--storage-backend", "nope"],
        ["--storage-backend", "file", "--storage-backend-config", '{"root": "/x", "y": 1}'],
        ["--storage-backend", "memory", "--storage-managers", "kv,vision"],
        ["--storage-backend", "memory", "--hicache-storage-backend", "mooncake"],
    )]

    # Built without prepare_server_args (bench scripts): from_cli_args translates too.
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    direct = ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", "m", "--storage-backend", "memory"]))
    out["direct"] = direct.hicache_storage_backend
    try:
        ServerArgs.from_cli_args(parser.parse_args(
            ["--model-path", "m", "--storage-backend", "memory", "--disable-radix-cache"]))
    except ValueError as error:
        out["direct_error"] = [type(error).__name__, str(error)]
    plain = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m"]))
    out["plain"] = json.loads(json.dumps(msgspec.structs.asdict(plain), default=repr))
    print(json.dumps(out))
    """
)


def test_patched_copy_serves_the_storage_flags(installed: SGLangTree, tmp_path: Path) -> None:
    """Whole package: apply, --help, ServerArgs, revert, byte-identical."""
    site = tmp_path / "site"
    copy = site / "sglang"
    patches = load_patches(PATCHES_DIR)
    pristine_copy(installed, copy, patches)  # with __pycache__: fast imports
    pristine = _snapshot(copy)
    tree = locate_sglang(copy)
    apply_patches(tree, patches)

    env = {**QUIET_ENV, "PYTHONPATH": f"{site}{os.pathsep}{QUIET_ENV.get('PYTHONPATH', '')}"}
    # Both subprocesses import SGLang (seconds each); run them side by side.
    helping = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    probing = subprocess.Popen(
        [sys.executable, "-c", SERVER_ARGS_PROBE, str(tmp_path / "kv")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    help_out, help_err = helping.communicate(timeout=240)
    probe_out, probe_err = probing.communicate(timeout=240)
    assert helping.returncode == 0, help_err[-3000:]
    assert probing.returncode == 0, probe_err[-3000:]

    for flag in (
        "--storage-backend NAME",
        "--storage-backend-config JSON|@FILE",
        "--storage-host-memory SIZE",
        "--storage-write-policy {write_through,write_through_selective,write_back}",
        "--storage-prefetch-policy {best_effort,wait_complete,timeout}",
        "--storage-managers LIST",
    ):
        assert flag in help_out, flag
    assert "--hicache-storage-backend" in help_out  # SGLang's own flags are still there

    probe = json.loads(probe_out.strip().splitlines()[-1])
    assert probe["module"] == str(copy / PATCHED_FILE)
    good = probe["good"]
    extra = json.loads(good.pop("hicache_storage_backend_extra_config"))
    assert good == {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "dynamic",
        "hicache_size": 68,
        "hicache_write_policy": "write_back",
        "hicache_storage_prefetch_policy": "wait_complete",
    }
    assert extra["module_path"] == "sglang_storage_adapters.hicache_storage"
    assert extra["storage_options"] == {"root": str(tmp_path / "kv")}
    codes = [code for code, _ in probe["bad"]]
    assert codes == [2, 2, 2, 2]
    lines = [line for _, line in probe["bad"]]
    assert "argument --storage-backend: is not a known sglang_storage backend" in lines[0]
    assert "file backend options (--storage-backend-config).y: unknown option" in lines[1]
    assert "'vision'" in lines[2]
    assert "names no sglang_storage manager" in lines[2]
    assert "--storage-backend with --hicache-storage-backend: cannot be combined" in lines[3]
    assert probe["direct"] == "dynamic"
    assert probe["direct_error"][0] == "ConfigError"
    assert "--disable-radix-cache" in probe["direct_error"][1]

    # Without --storage-* flags the patched ServerArgs equals the unpatched one.
    import argparse

    import msgspec
    from sglang.srt.server_args import ServerArgs

    assert ServerArgs.__module__ == "sglang.srt.server_args"
    plain_parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(plain_parser)
    unpatched = ServerArgs.from_cli_args(plain_parser.parse_args(["--model-path", "m"]))
    expected = json.loads(json.dumps(msgspec.structs.asdict(unpatched), default=repr))
    assert probe["plain"] == expected

    revert_patches(tree, patches)
    assert _snapshot(copy) == pristine
