"""The series: applies as deterministic commits, fails naming the file, exports canonically."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hotggml import cli, gitutil, patches, paths, pin
from hotggml.errors import PatchError, PinError

LOCAL_SDIST = Path("/tmp/dl") / pin.SDIST_FILE
FIRST = "alloc-free-blocks.patch"


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    """The pin materialized once per session (same place as test_pin's, so fetched once)."""
    dest = tmp_path_factory.getbasetemp() / "pin" / "ggml"
    sdist = next((p for p in (LOCAL_SDIST, paths.cache_dir() / pin.SDIST_FILE) if p.is_file()), None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(paths.STATE_ENV, str(tmp_path_factory.getbasetemp() / "session-state"))
        patch.delenv(pin.SDIST_ENV, raising=False)
        pin.fetch(sdist, dest=dest, cache_dir=paths.REPO_ROOT / ".hotggml" / "cache")
    return dest


@pytest.fixture(autouse=True)
def isolated_state(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.STATE_ENV, str(tmp_path / "state"))


@pytest.fixture
def series_dir(tmp_path) -> Path:
    """A private copy of patches/ that a test may break."""
    copy = tmp_path / "patches"
    shutil.copytree(paths.PATCHES_DIR, copy)
    return copy


@pytest.fixture
def applied(pristine, series_dir, tmp_path) -> patches.ApplyResult:
    return patches.apply(tmp_path / "work" / "ggml", patches_dir=series_dir, pin_dir=pristine)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"fixture drift: {old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_apply_makes_one_deterministic_commit_per_patch(applied, pristine, series_dir, tmp_path):
    names = [patch.name for patch in patches.load_series(series_dir)]
    assert [name for name, _ in applied.commits] == names
    assert not applied.already_applied and applied.pin_commit == pin.SDIST_PIN_COMMIT
    again = patches.apply(tmp_path / "other" / "ggml", patches_dir=series_dir, pin_dir=pristine)
    assert again.commits == applied.commits


def test_apply_twice_says_already_applied(applied, pristine, series_dir):
    again = patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine)
    assert again.already_applied and again.commits == applied.commits
    assert again.series_hash == applied.series_hash == patches.series_hash(series_dir)


def test_export_round_trip_is_byte_identical(applied, series_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "series").write_bytes((series_dir / "series").read_bytes())
    patches.export(out, tree=applied.tree)
    for entry in patches.series_entries(series_dir) + ["series"]:
        assert (out / entry).read_bytes() == (series_dir / entry).read_bytes(), entry
    assert patches.export(series_dir, dry_run=True, tree=applied.tree) == []


def test_export_dry_run_names_stale_file(applied, series_dir):
    edit(series_dir / FIRST, "Why: the dynamic", "Why: the  dynamic")
    assert patches.export(series_dir, dry_run=True, tree=applied.tree) == [series_dir / FIRST]
    assert "the  dynamic" in (series_dir / FIRST).read_text()  # dry run writes nothing


def test_export_refuses_commit_without_patch_name(applied, series_dir):
    (applied.tree / "NOTES").write_text("x\n")
    gitutil.commit_all(gitutil.open_repo(applied.tree), "no trailers here", pin.PIN_IDENTITY)
    with pytest.raises(PatchError, match="no `Patch-Name: <name>` trailer"):
        patches.export(series_dir, dry_run=True, tree=applied.tree)


def test_apply_keeps_unexported_and_uncommitted_work(applied, pristine, series_dir):
    alloc = applied.tree / "src" / "ggml-alloc.c"
    alloc.write_text(alloc.read_text() + "// wip\n")
    with pytest.raises(PatchError, match="uncommitted changes.*src/ggml-alloc.c"):
        patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine)
    message = "more\n\nPatch-Name: wip\nUpstream-Status: fork-only\nMarker: src/ggml-alloc.c: // wip\n"
    gitutil.commit_all(gitutil.open_repo(applied.tree), message, pin.PIN_IDENTITY)
    with pytest.raises(PatchError, match="not exported.*wip.patch"):
        patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine)
    assert patches.export(series_dir, tree=applied.tree)  # exported: now it is the series
    assert patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine).already_applied
    assert "wip.patch" in patches.series_entries(series_dir)


def test_export_refuses_commits_the_series_could_not_take_back(applied, series_dir):
    repo = gitutil.open_repo(applied.tree)
    trailers = "Patch-Name: odd\nUpstream-Status: fork-only\nMarker: src/ggml-alloc.c: // odd\n"
    gitutil.run(repo, "commit", "-q", "--allow-empty", "-m", "empty\n\n" + trailers,
                config={"user.name": "u", "user.email": "u@invalid"})
    with pytest.raises(PatchError, match="changes no file"):
        patches.export(series_dir, dry_run=True, tree=applied.tree)
    gitutil.run(repo, "reset", "-q", "--hard", "HEAD~1")
    alloc = applied.tree / "src" / "ggml-alloc.c"
    alloc.write_text(alloc.read_text() + "// odd\n")
    gitutil.commit_all(repo, "odd\n\nwhy\n---\nmore\n\n" + trailers, pin.PIN_IDENTITY)
    with pytest.raises(PatchError, match="has a line '---' in its message"):
        patches.export(series_dir, dry_run=True, tree=applied.tree)
    # git am ends the message at these too (mailinfo's patchbreak): the export failed `check` later
    for line in ("Index: explain things", "diff -u is how it was made"):
        gitutil.run(repo, "commit", "-q", "--amend", "-m", f"odd\n\nwhy\n{line}\n\n" + trailers,
                    config={"user.name": "u", "user.email": "u@invalid"})
        with pytest.raises(PatchError, match=f"has a line '{line}' in its message"):
            patches.export(series_dir, dry_run=True, tree=applied.tree)


def test_apply_keeps_stashes_and_branches_with_commits_of_their_own(applied, pristine, series_dir):
    # the tree is replaced whole when the series changes: a stash or a side branch in it went without a word
    repo = gitutil.open_repo(applied.tree)
    alloc = applied.tree / "src" / "ggml-alloc.c"
    edit(series_dir / FIRST, "Why:", "Why :")  # the series changed
    alloc.write_text(alloc.read_text() + "// wip\n")
    gitutil.run(repo, "stash", config={"user.name": "u", "user.email": "u@invalid"})
    with pytest.raises(PatchError, match="1 stash entry"):
        patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine)
    gitutil.run(repo, "stash", "drop")
    gitutil.run(repo, "checkout", "-q", "-b", "experiment")
    alloc.write_text(alloc.read_text() + "// experiment\n")
    gitutil.commit_all(repo, "experiment", pin.PIN_IDENTITY)
    gitutil.run(repo, "checkout", "-q", patches.WORK_BRANCH)
    with pytest.raises(PatchError, match="branch experiment with commits of its own"):
        patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine)
    gitutil.run(repo, "branch", "-q", "-D", "experiment")
    gitutil.run(repo, "branch", "-q", "merged", "HEAD~1")  # nothing of its own: no reason to refuse
    assert not patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine).already_applied


def test_export_refuses_what_would_drop_or_overwrite_patches(applied, series_dir, monkeypatch):
    repo = gitutil.open_repo(applied.tree)
    before = {path.name: path.read_bytes() for path in series_dir.iterdir()}
    gitutil.run(repo, "checkout", "-q", "--detach", "HEAD~3")  # the later patches would be dropped
    with pytest.raises(PatchError, match="detached HEAD"):
        patches.export(series_dir, tree=applied.tree)
    assert {path.name: path.read_bytes() for path in series_dir.iterdir()} == before
    gitutil.run(repo, "checkout", "-q", patches.WORK_BRANCH)
    (Path(repo.git_dir) / "rebase-merge").mkdir()  # as `git rebase -i` stopped at an edit leaves it
    with pytest.raises(PatchError, match="a rebase is in progress"):
        patches.export(series_dir, tree=applied.tree)
    (Path(repo.git_dir) / "rebase-merge").rmdir()
    # the checkout's patches/ changed after the tree was made from it: a colleague's patch, listed
    monkeypatch.setattr(paths, "PATCHES_DIR", series_dir)
    (series_dir / "colleague.patch").write_bytes(before[FIRST])
    (series_dir / "series").write_text((series_dir / "series").read_text() + "colleague.patch\n")
    edited = {path.name: path.read_bytes() for path in series_dir.iterdir()}
    with pytest.raises(PatchError, match="changed since the work tree"):
        patches.export(series_dir, tree=applied.tree)
    assert {path.name: path.read_bytes() for path in series_dir.iterdir()} == edited
    assert series_dir / "colleague.patch" in patches.export(series_dir, tree=applied.tree, force=True)
    assert not (series_dir / "colleague.patch").exists()  # --force: the tree's commits are the series


def test_a_series_or_patch_that_is_not_utf8_is_named(series_dir):
    (series_dir / "series").write_bytes(b"# caf\xe9\n" + (series_dir / "series").read_bytes())
    with pytest.raises(PatchError, match="series is not UTF-8 \\(byte 0xe9 at line 1\\)"):
        patches.load_series(series_dir)
    with pytest.raises(PatchError, match="series is not UTF-8"):  # export keeps the series' comment block
        patches._series_text(series_dir / "series", [])


def test_check_finds_a_marker_a_later_patch_removed(applied, pristine, series_dir):
    first = patches.load_series(series_dir)[0]
    marker = first.markers[0]
    path = applied.tree / marker.path
    path.write_text(path.read_text().replace(marker.text, "removed later") + "// zap\n")
    message = f"zap\n\nPatch-Name: zap\nUpstream-Status: fork-only\nMarker: {marker.path}: // zap\n"
    gitutil.commit_all(gitutil.open_repo(applied.tree), message, pin.PIN_IDENTITY)
    patches.export(series_dir, tree=applied.tree)
    with pytest.raises(PatchError, match=f"{first.path.name}: marker .* is gone from the fully patched tree"):
        patches.check(patches_dir=series_dir, pin_dir=pristine)


def test_check_refuses_a_marker_the_pristine_pin_holds(pristine, series_dir):
    path = series_dir / FIRST
    text = path.read_text()
    marker = next(line for line in text.splitlines() if line.startswith("Marker: "))
    path.write_text(text.replace(marker, "Marker: CMakeLists.txt: project(", 1))  # upstream's own line
    with pytest.raises(PatchError, match=f"{FIRST}: marker 'project\\(' is in CMakeLists.txt of the pristine pin"):
        patches.check(patches_dir=series_dir, pin_dir=pristine)


def test_check_passes_on_the_real_series(pristine, series_dir):
    result = patches.check(patches_dir=series_dir, pin_dir=pristine)
    assert len(result.commits) == len(patches.series_entries(series_dir))
    assert not result.tree.exists()  # scratch tree is gone


def test_check_names_crlf_patch(pristine, series_dir):
    path = series_dir / FIRST
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    with pytest.raises(PatchError, match=f"{FIRST} has CRLF line endings"):
        patches.check(patches_dir=series_dir, pin_dir=pristine)


def test_crlf_target_names_the_target_not_does_not_apply(pristine, series_dir, tmp_path):
    tree = tmp_path / "ggml"
    repo = gitutil.clone_local(pristine, tree)
    gitutil.checkout_branch(repo, "pin", "HEAD")
    target = tree / "src" / "ggml-alloc.c"
    target.write_bytes(target.read_bytes().replace(b"\n", b"\r\n"))
    gitutil.commit_all(repo, "crlf", pin.PIN_IDENTITY)
    with pytest.raises(PatchError, match="target file src/ggml-alloc.c has CRLF") as error:
        patches.apply_series(tree, patches.load_series(series_dir)[:1])
    assert "does not apply" not in str(error.value)


def test_check_names_missing_marker(pristine, series_dir):
    edit(series_dir / FIRST, "Marker: src/ggml-alloc.c: #define MAX_FREE_BLOCKS 1024",
         "Marker: src/ggml-alloc.c: #define MAX_FREE_BLOCKS 4096")
    with pytest.raises(PatchError, match=f"{FIRST}: marker '#define MAX_FREE_BLOCKS 4096' not found in "
                                         f"src/ggml-alloc.c"):
        patches.check(patches_dir=series_dir, pin_dir=pristine)


def test_series_whose_hunks_fail_is_refused_and_old_tree_kept(applied, pristine, series_dir):
    edit(series_dir / FIRST, "-#define MAX_FREE_BLOCKS 256", "-#define MAX_FREE_BLOCKS 512")
    with pytest.raises(PatchError, match=f"{FIRST} does not apply to src/ggml-alloc.c"):
        patches.apply(applied.tree, patches_dir=series_dir, pin_dir=pristine)
    repo = gitutil.open_repo(applied.tree)
    assert gitutil.rev_parse(repo, "HEAD") == applied.commits[-1][1]
    assert not list(applied.tree.parent.glob(".ggml.*"))


def test_apply_refuses_a_folder_that_is_not_a_repository_root(pristine, series_dir, tmp_path):
    repo = gitutil.clone_local(pristine, tmp_path / "ggml")
    gitutil.checkout_branch(repo, "pin", "HEAD")
    with pytest.raises(PatchError, match="not the root of a git repository"):
        patches.apply_series(tmp_path / "ggml" / "src", patches.load_series(series_dir))


def test_apply_refuses_dirty_pin(pristine, series_dir, tmp_path):
    copy = tmp_path / "pin"
    gitutil.checkout_branch(gitutil.clone_local(pristine, copy), "pin", "HEAD")
    (copy / "src" / "stray.c").write_text("\n")
    with pytest.raises(PinError, match="dirty: src/stray.c"):
        patches.apply(tmp_path / "work", patches_dir=series_dir, pin_dir=copy)


def test_patch_name_must_match_file(series_dir):
    shutil.move(series_dir / FIRST, series_dir / "renamed.patch")
    edit(series_dir / "series", FIRST, "renamed.patch")
    with pytest.raises(PatchError, match="Patch-Name is 'alloc-free-blocks' but the file is renamed.patch"):
        patches.load_series(series_dir)


def test_check_refuses_unlisted_patch(pristine, series_dir):
    shutil.copy(series_dir / FIRST, series_dir / "stray.patch")
    with pytest.raises(PatchError, match="stray.patch .* not listed"):
        patches.check(patches_dir=series_dir, pin_dir=pristine)


def test_status_reports_applied_stale_and_not_applied(applied, series_dir, tmp_path):
    report = patches.status(patches_dir=series_dir, tree=applied.tree)
    assert {entry.state for entry in report} == {patches.APPLIED} and all(e.markers_ok for e in report)
    edit(series_dir / FIRST, "Why: the dynamic", "Why: the  dynamic")
    report = patches.status(patches_dir=series_dir, tree=applied.tree)
    assert {entry.state for entry in report} == {patches.STALE}
    report = patches.status(patches_dir=series_dir, tree=tmp_path / "missing")
    assert {entry.state for entry in report} == {patches.NOT_APPLIED}
    assert not any(entry.markers_ok for entry in report)


def test_series_hash_changes_with_any_byte(series_dir):
    before = patches.series_hash(series_dir)
    edit(series_dir / FIRST, "Why:", "Why :")
    assert patches.series_hash(series_dir) != before


def test_series_hash_ignores_series_layout_but_not_order(series_dir):
    """Comments, blank lines and spacing in the series file apply nothing different (no "stale" after
    them); listing the same patches in another order does."""
    series = series_dir / "series"
    before = patches.series_hash(series_dir)
    names = [line for line in series.read_text().splitlines() if line.strip() and not line.startswith("#")]
    series.write_text("# reviewed\n\n" + "".join(f"  {name}   # ok\n" for name in names) + "\n")
    assert patches.series_hash(series_dir) == before
    series.write_text("".join(f"{name}\n" for name in [names[1], names[0], *names[2:]]))
    assert patches.series_hash(series_dir) != before


def test_cli_reports_errors_with_exit_code_2(capsys):
    assert cli.main(["patches", "export", "--dry-run"]) == 2  # no work tree in the isolated state dir
    assert capsys.readouterr().err.startswith("hotggml: error: ")


def test_autocrlf_clone_keeps_patches_and_scripts_lf(pristine, tmp_path):
    """.gitattributes: a clone made with core.autocrlf=true checks out every patch and script with LF,
    and its series passes `patches check` (a CR in a patch would change its bytes and its hash)."""
    import git

    if not (paths.REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = git.Repo.clone_from(str(paths.REPO_ROOT), str(tmp_path / "clone"), no_checkout=True)
    clone.git.config("core.autocrlf", "true")  # what `git clone -c core.autocrlf=true` sets, before checkout
    clone.git.reset("--hard", "HEAD")
    assert clone.git.config("core.autocrlf") == "true"
    root = Path(clone.working_tree_dir)
    scripts = [*root.glob("ci/*.sh"), root / ".ci" / "run", *root.glob("tools/*.sh"), *root.glob("hotggml/*.py")]
    checked = [*sorted((root / "patches").iterdir()), *scripts]
    assert len(checked) > 10
    for path in checked:
        assert b"\r" not in path.read_bytes(), f"{path.relative_to(root)} came out with CRLF"
    # the patches are the committed bytes (what the series hash, and so every build key, is made of)
    for path in sorted((root / "patches").iterdir()):
        blob = subprocess.run(["git", "-C", str(root), "cat-file", "blob", f"HEAD:patches/{path.name}"],
                              capture_output=True, check=True).stdout
        assert path.read_bytes() == blob, f"{path.name} differs from its committed bytes"
    patches.check(patches_dir=root / "patches", pin_dir=pristine)


# -- Upstream-Status and the upstream export -------------------------------------------------------

def _am(pristine: Path, files: list[Path], where: Path):
    import git

    repo = git.Repo.clone_from(str(pristine), str(where))
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", "upstream maintainer")
        cfg.set_value("user", "email", "maintainer@invalid")
    repo.git.am(*[str(f) for f in files])
    return repo


def _bound(series_dir: Path) -> tuple[list[str], list[str]]:
    """The series' submit and fork-only patch names, in order."""
    entries = patches.series_entries(series_dir)
    status = {n: patches.parse_patch(series_dir / n).upstream for n in entries}
    return [n for n in entries if status[n] == "submit"], [n for n in entries if status[n] == "fork-only"]


def test_upstream_export_applies_with_git_am_onto_the_pristine_pin(applied, pristine, series_dir, tmp_path):
    files = patches.export_upstream(tmp_path / "upstream", patches_dir=series_dir)
    submit, fork_only = _bound(series_dir)
    assert [f.name for f in files] == [f"{i + 1:04d}-{n}" for i, n in enumerate(submit)]
    # the fork-only patches close the series, so the submit ones alone are the work repo minus its last commits
    assert patches.series_entries(series_dir)[len(submit):] == fork_only
    for f in files:
        text = f.read_text()
        assert not any(line.startswith(("Patch-Name:", "Marker:", "Upstream-Status:")) for line in text.split("\n"))
        assert "diff --git" in text
    repo = _am(pristine, files, tmp_path / "am")
    work = gitutil.open_repo(applied.tree)
    assert repo.git.rev_parse("HEAD^{tree}") == work.git.rev_parse(f"HEAD~{len(fork_only)}^{{tree}}")  # the same tree
    assert len(repo.git.rev_list(f"{pin.SDIST_PIN_COMMIT}..HEAD").split()) == len(files)


def test_fork_only_patch_stays_out_of_the_upstream_export(pristine, series_dir, tmp_path):
    submit, fork_only = _bound(series_dir)
    assert fork_only == ["rpc-fork-major.patch"]  # the series' own fork-only patch
    last = series_dir / submit[-1]
    edit(last, "Upstream-Status: submit", "Upstream-Status: fork-only")
    files = patches.export_upstream(tmp_path / "upstream", patches_dir=series_dir)
    names = " ".join(f.name for f in files)
    assert last.stem not in names and "rpc-fork-major" not in names and len(files) == len(submit) - 1
    _am(pristine, files, tmp_path / "am")  # the submit patches stand without the fork-only one
    assert patches.parse_patch(last).upstream == "fork-only"


@pytest.mark.parametrize("old,new,match", [
    ("Upstream-Status: submit\n", "", "Upstream-Status: ` must say where the patch is bound"),
    ("Upstream-Status: submit", "Upstream-Status: maybe", "Upstream-Status: maybe` must say"),
])
def test_upstream_status_is_required(series_dir, old, new, match):
    first = series_dir / FIRST
    edit(first, old, new)
    with pytest.raises(PatchError, match=match):
        patches.parse_patch(first)


def test_a_patch_that_adds_conflict_markers_is_refused(series_dir):
    """A conflict `git add`ed unresolved and exported: the series applied, the Markers were found, and `patches
    check` passed; only a compile failed. The added lines `<<<<<<< ` / `>>>>>>> ` are refused by name."""
    first = series_dir / FIRST
    text = first.read_text()
    hunk = text.index("\n+", text.index("\n@@ "))  # the first added line of the diff
    first.write_text(text[:hunk] + "\n+<<<<<<< HEAD" + text[hunk:])
    with pytest.raises(PatchError, match="adds a merge conflict marker"):
        patches.parse_patch(first)


def test_a_series_with_a_byte_order_mark_is_named(series_dir):
    """An editor's BOM before the first name: "listed in the series but there is no such .patch file", of a
    file that plainly exists (the BOM is invisible)."""
    series = series_dir / "series"
    series.write_bytes("\ufeff".encode() + series.read_bytes())
    with pytest.raises(PatchError, match="starts with a UTF-8 byte order mark"):
        patches.load_series(series_dir)


def test_upstream_export_refuses_a_non_empty_folder(series_dir, tmp_path):
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "keep.txt").write_text("mine\n")
    with pytest.raises(PatchError, match="not empty"):
        patches.export_upstream(tmp_path / "up", patches_dir=series_dir)
    assert (tmp_path / "up" / "keep.txt").read_text() == "mine\n"


def test_code_hash_follows_git_am_not_the_diff_header(tmp_path):
    """The code hash starts where git am ends a patch's message: a plain unified diff (no `diff --git` line),
    which git am applies, still counts, and a message edit does not."""
    from hotggml import series

    d = tmp_path / "p"
    d.mkdir()
    (d / "series").write_text("a.patch\n")
    head = "From 0 Mon Sep 17 00:00:00 2001\nSubject: x\n\nWhy: a reason\n\nPatch-Name: a\n\n"
    body = "--- a/f.c\n+++ b/f.c\n@@ -1 +1 @@\n-int x = 1;\n+int x = %d;\n"
    (d / "a.patch").write_text(head + body % 2)
    first = series.code_hash(d)
    (d / "a.patch").write_text(head.replace("a reason", "another reason") + body % 2)
    assert series.code_hash(d) == first
    (d / "a.patch").write_text(head + body % 3)
    assert series.code_hash(d) != first


def test_a_patch_on_names_git_quotes_exports_and_checks(applied, pristine, series_dir):
    """git writes a name with a space with a tab after it on the ---/+++ lines, and one with a non-ASCII byte or a
    quote C-quoted: such a patch exported, then failed `check` ("applied but left docs/sp ace/my file.txt<TAB>
    unchanged"), however regenerated."""
    repo = gitutil.open_repo(applied.tree)
    for rel in ("docs/sp ace/my file.txt", "docs/caf\u00e9 \"q\".txt"):
        path = applied.tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("marker-space\n")
    gitutil.commit_all(repo, "odd names\n\nWhy: names git quotes.\n\nPatch-Name: odd-names\nUpstream-Status: fork-only\n"
                             "Marker: docs/sp ace/my file.txt: marker-space\n", pin.PIN_IDENTITY)
    assert patches.export(series_dir, tree=applied.tree)
    assert gitutil.paths_in_patch((series_dir / "odd-names.patch").read_text(), new_files=True) == [
        "docs/caf\u00e9 \"q\".txt", "docs/sp ace/my file.txt"]
    patches.check(patches_dir=series_dir, pin_dir=pristine)


@pytest.mark.parametrize("entry", ["/tmp/elsewhere/x.patch", "../x.patch", "sub/x.patch", "..\\x.patch"])
def test_a_series_entry_is_a_file_name_not_a_path(series_dir, entry):
    """export removed a file a path in the series named, outside patches/ (`removed /tmp/.../x.patch`)."""
    series = series_dir / "series"
    series.write_text(series.read_text() + entry + "\n")
    with pytest.raises(PatchError, match="an entry is a file name in .*, not a path"):
        patches.series_entries(series_dir)


def test_comments_between_entries_stay_and_pass_check(pristine, series_dir):
    """A comment or blank line between entries (the series documents `#` comments): export dropped it, so
    `check` failed with "export is not canonical ... changes series", naming no cause."""
    series = series_dir / "series"
    lines = series.read_text().splitlines()
    series.write_text("\n".join([lines[0], "", "# the backward fixes:", lines[1] + "  # why this one", *lines[2:]]) + "\n")
    patches.check(patches_dir=series_dir, pin_dir=pristine)


def test_an_export_cut_off_while_writing_is_finished_by_the_next(applied, series_dir, monkeypatch):
    """An export stopped between its patch files and the series (a kill, a full disk) left patches/ half
    written; the next export took that for a hand edit ("changed since the work tree was made") and so did
    apply: only --force got out."""
    monkeypatch.setattr(paths, "PATCHES_DIR", series_dir)
    repo = gitutil.open_repo(applied.tree)
    alloc = applied.tree / "src" / "ggml-alloc.c"
    alloc.write_text(alloc.read_text() + "// more\n")
    gitutil.run(repo, "commit", "-q", "-a", "--amend", "--no-edit", config={"user.name": "u", "user.email": "u@invalid"})
    real = patches._write_all

    def cut_off(out_dir, outputs, changed, removed):
        real(out_dir, outputs, [path for path in changed if path.name != "series"], [])
        raise KeyboardInterrupt

    # the series' last patch rewritten (the amend moved the commit ids in its header), the series not yet
    monkeypatch.setattr(patches, "_write_all", cut_off)
    with pytest.raises(KeyboardInterrupt):
        patches.export(series_dir, tree=applied.tree)
    monkeypatch.setattr(patches, "_write_all", real)
    patches.export(series_dir, tree=applied.tree)
    assert patches.export(series_dir, dry_run=True, tree=applied.tree) == []
    assert "// more" in (series_dir / patches.series_entries(series_dir)[-1]).read_text()


def test_a_work_repo_recorded_with_the_former_series_hash_is_current(applied, series_dir, monkeypatch):
    """A work repo made before series_hash stopped counting the series file's comments records the former
    value: read as today's when it is patches/' own, so an upgrade neither marks every patch stale nor makes
    export take patches/ for hand-edited (its unexported commits were stranded: only --force got out)."""
    monkeypatch.setattr(paths, "PATCHES_DIR", series_dir)
    repo = gitutil.open_repo(applied.tree)
    gitutil.config_set(repo, {patches.CONFIG_SERIES: patches.series_hash_v1(series_dir)})
    assert patches.series_hash_v1(series_dir) != patches.series_hash(series_dir)
    assert {entry.state for entry in patches.status(patches_dir=series_dir, tree=applied.tree)} == {patches.APPLIED}
    alloc = applied.tree / "src" / "ggml-alloc.c"
    alloc.write_text(alloc.read_text() + "// my fix\n")
    gitutil.commit_all(repo, "my fix\n\nWhy: a fix.\n\nPatch-Name: my-fix\nUpstream-Status: fork-only\n"
                             "Marker: src/ggml-alloc.c: // my fix\n", pin.PIN_IDENTITY)
    assert series_dir / "my-fix.patch" in patches.export(series_dir, tree=applied.tree)
    gitutil.config_set(repo, {patches.CONFIG_SERIES: "0" * 64})  # another series: still refused
    edit(series_dir / FIRST, "Why:", "Why :")
    with pytest.raises(PatchError, match="changed since the work tree"):
        patches.export(series_dir, tree=applied.tree)


def test_an_export_that_changes_the_entries_keeps_the_comments(applied, series_dir, monkeypatch):
    """A comment between entries is no edit series_hash sees: an export whose entries changed rewrote the series
    from its leading comment block and dropped it without a word."""
    monkeypatch.setattr(paths, "PATCHES_DIR", series_dir)
    series = series_dir / "series"
    names = patches.series_entries(series_dir)
    series.write_text(series.read_text().replace(f"{names[2]}\n", f"# keep: why these two\n{names[2]}  # and this\n"))
    gitutil.run(gitutil.open_repo(applied.tree), "reset", "-q", "--hard", "HEAD~1")  # the last patch goes
    assert series in patches.export(series_dir, tree=applied.tree)
    text = series.read_text()
    assert f"# keep: why these two\n{names[2]}  # and this\n" in text and names[-1] not in text
    assert patches.series_entries(series_dir) == names[:-1]


def test_an_export_cut_off_before_its_removals_is_finished_by_the_next(applied, series_dir, monkeypatch):
    """Cut off after the series was written but before the patches it dropped were removed: the next export
    computed what to remove from the new series, left the orphan, and `check` failed ("not listed")."""
    monkeypatch.setattr(paths, "PATCHES_DIR", series_dir)
    last = patches.series_entries(series_dir)[-1]
    gitutil.run(gitutil.open_repo(applied.tree), "reset", "-q", "--hard", "HEAD~1")
    real = patches._write_all

    def cut_off(out_dir, outputs, changed, removed):
        real(out_dir, outputs, changed, [])
        raise KeyboardInterrupt

    monkeypatch.setattr(patches, "_write_all", cut_off)
    with pytest.raises(KeyboardInterrupt):
        patches.export(series_dir, tree=applied.tree)
    monkeypatch.setattr(patches, "_write_all", real)
    assert (series_dir / last).exists() and last not in patches.series_entries(series_dir)
    assert series_dir / last in patches.export(series_dir, tree=applied.tree)
    assert not (series_dir / last).exists() and patches.export(series_dir, dry_run=True, tree=applied.tree) == []
