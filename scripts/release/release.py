#!/usr/bin/env python3
"""The checks of scripts/release-check.sh that read files: one subcommand each.

  meta ROOT [TAG]              versions and addresses agree across every package; CHANGELOG.md
                               has "## [Unreleased]" above release headings "## [X.Y.Z] - DATE";
                               with TAG (vX.Y.Z) the versions are X.Y.Z and its section is dated
  notes ROOT VERSION|Unreleased OUT   writes that CHANGELOG section's body (the release notes)
  rehearse ROOT WORK           a release 9.9.9 cut in a copy (versions bumped, [Unreleased] renamed
                               and dated): meta and notes pass on it as on a tag
  crate-check CRATE_FILE NAME  a packaged .crate: its files (none of target/, tests/, the book...;
                               what the build reads is there) and its manifest's metadata
  sbom-fix SBOM UNPACKED        the packages' local paths in the SBOM named as crates.io's
  sbom-check SBOM LOCKFILE TREE NAME VERSION   a CycloneDX SBOM names the binary and every crate
                               it is built from (TREE: cargo tree), at their locked versions
  wheel-check WHEEL SDIST VERSION     the Python distributions' files and metadata
  npm-check TGZ VERSION        the npm tarball's files and package.json
Each prints what it checked and exits 1 with the reason on a failure.
"""

import email.parser
import json
import re
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

SEMVER = r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?"
HEADING = re.compile(r"^## \[(?P<v>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?\s*$")
CRATE_LIMIT = 10 * 1024 * 1024  # crates.io refuses a larger .crate


def fail(msg):
    print(f"  FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def ok(msg):
    print(f"  {msg}")


def versions(root):
    """Every version and repository address the release publishes, by where it is written."""
    root = Path(root)
    out, repos = {}, {}
    for manifest in ["Cargo.toml", "crates/zdelay-core/Cargo.toml", "crates/zdelay-client/Cargo.toml"]:
        pkg = tomllib.loads((root / manifest).read_text())["package"]
        out[manifest] = pkg["version"]
        repos[manifest] = pkg.get("repository")
    chart = (root / "charts/zdelay/Chart.yaml").read_text()
    out["charts/zdelay/Chart.yaml version"] = re.search(r"^version:\s*(\S+)", chart, re.M).group(1)
    out["charts/zdelay/Chart.yaml appVersion"] = re.search(
        r"^appVersion:\s*\"?([^\"\s]+)", chart, re.M).group(1)
    sources = re.search(r"^sources:\s*\n\s*-\s*(\S+)", chart, re.M)
    repos["charts/zdelay/Chart.yaml sources"] = sources.group(1) if sources else None
    py = tomllib.loads((root / "clients/python/pyproject.toml").read_text())["project"]
    out["clients/python/pyproject.toml"] = py["version"]
    repos["clients/python/pyproject.toml"] = py.get("urls", {}).get("Repository")
    node = json.loads((root / "clients/node/package.json").read_text())
    out["clients/node/package.json"] = node["version"]
    repo = node.get("repository", {})
    url = repo.get("url", "") if isinstance(repo, dict) else repo
    repos["clients/node/package.json"] = re.sub(r"^git\+|\.git$", "", url) or None
    # The clients' own release constants (a namespace asking for a newer release is refused).
    for src in ["clients/python/src/zdelay/_core.py", "clients/node/src/index.ts"]:
        m = re.search(r'^(?:export const )?VERSION = "([^"]+)"', (root / src).read_text(), re.M)
        out[src + " VERSION"] = m.group(1) if m else None
    book = tomllib.loads((root / "docs/book.toml").read_text())
    repos["docs/book.toml"] = book.get("output", {}).get("html", {}).get("git-repository-url")
    return out, repos


def changelog_sections(root):
    """[(version, date, body)] in file order."""
    sections, cur = [], None
    for line in (Path(root) / "CHANGELOG.md").read_text().splitlines():
        m = HEADING.match(line)
        if m:
            cur = [m["v"], m["date"], []]
            sections.append(cur)
        elif line.startswith("## "):
            fail(f"CHANGELOG.md: a release heading must read '## [X.Y.Z] - YYYY-MM-DD' (or "
                 f"'## [Unreleased]'): {line!r}")
        elif cur is not None:
            cur[2].append(line)
    return [(v, d, "\n".join(b).strip() + "\n") for v, d, b in sections]


def meta(root, tag=None):
    vers, repos = versions(root)
    distinct = set(vers.values())
    if len(distinct) != 1:
        fail("the packages' versions differ:\n" + "\n".join(f"    {k}: {v}" for k, v in vers.items()))
    (version,) = distinct
    if not re.fullmatch(SEMVER, version):
        fail(f"version {version} is not semver")
    ok(f"version {version} in all of: {', '.join(vers)}")
    missing = [k for k, v in repos.items() if not v]
    if missing:
        fail(f"no repository address in {', '.join(missing)}")
    if len(set(repos.values())) != 1:
        fail("the repository addresses differ:\n" + "\n".join(f"    {k}: {v}" for k, v in repos.items()))
    ok(f"repository {next(iter(repos.values()))} in every package and the book")
    sections = changelog_sections(root)
    if not sections or sections[0][0] != "Unreleased":
        fail("CHANGELOG.md must open with '## [Unreleased]' above the releases")
    seen = set()
    for v, d, _ in sections[1:]:
        if not re.fullmatch(SEMVER, v):
            fail(f"CHANGELOG.md: release heading [{v}] is not a semver version")
        if v in seen:
            fail(f"CHANGELOG.md: [{v}] twice")
        seen.add(v)
    ok(f"CHANGELOG.md: [Unreleased] above {len(sections) - 1} release(s): "
       + ", ".join(f"{v}{' (' + d + ')' if d else ''}" for v, d, _ in sections[1:]))
    if tag:
        if tag != f"v{version}":
            fail(f"tag {tag} but the packages say {version} (tag v{version}, or bump the versions)")
        dated = [d for v, d, _ in sections if v == version]
        if not dated or not dated[0]:
            fail(f"tag {tag}: CHANGELOG.md has no '## [{version}] - YYYY-MM-DD' section "
                 "(rename [Unreleased] to it and open a new empty [Unreleased])")
        ok(f"tag {tag}: CHANGELOG.md section [{version}] - {dated[0]}")


def notes(root, version, out):
    for v, _, body in changelog_sections(root):
        if v == version:
            if not body.strip():
                fail(f"CHANGELOG.md section [{version}] is empty")
            Path(out).write_text(body)
            ok(f"release notes of [{version}]: {len(body.splitlines())} lines -> {out}")
            return
    fail(f"CHANGELOG.md has no section [{version}]")


def rehearse(root, work):
    """Cuts a release 9.9.9 in a copy of the versioned files, as a release commit would, and
    runs meta and notes on it as the tag's workflow does: the notes are the [Unreleased] body."""
    import datetime
    import shutil
    root, work = Path(root), Path(work)
    files = ["Cargo.toml", "crates/zdelay-core/Cargo.toml", "crates/zdelay-client/Cargo.toml",
             "charts/zdelay/Chart.yaml", "clients/python/pyproject.toml", "clients/node/package.json",
             "docs/book.toml", "clients/python/src/zdelay/_core.py", "clients/node/src/index.ts",
             "CHANGELOG.md"]
    current = tomllib.loads((root / "Cargo.toml").read_text())["package"]["version"]
    for f in files:
        (work / f).parent.mkdir(parents=True, exist_ok=True)
        text = (root / f).read_text()
        if f == "CHANGELOG.md":
            today = datetime.date.today().isoformat()
            text = text.replace("## [Unreleased]", f"## [Unreleased]\n\n## [9.9.9] - {today}", 1)
        else:
            text = re.sub(rf'^((?:version|appVersion)\s*[=:]\s*"?){re.escape(current)}', rf"\g<1>9.9.9",
                          text, flags=re.M)
            text = text.replace(f'"version": "{current}"', '"version": "9.9.9"', 1)
            text = re.sub(rf'^((?:export const )?VERSION = "){re.escape(current)}"', r'\g<1>9.9.9"', text, flags=re.M)
        (work / f).write_text(text)
    meta(work, "v9.9.9")
    notes(work, "9.9.9", work / "notes.md")
    unreleased = [b for v, _, b in changelog_sections(root) if v == "Unreleased"][0]
    if (work / "notes.md").read_text() != unreleased:
        fail("the rehearsed release's notes are not the [Unreleased] section")
    ok("a release cut as CHANGELOG.md says (9.9.9, tag v9.9.9) passes meta; its notes are [Unreleased]'s")


# What each crate must carry (the build reads it) and may never carry.
MUST = {
    "zdelay": ["src/main.rs", "src/lib.rs", "src/admin/ui/index.html", "src/admin/ui/app.js",
               "src/admin/ui/app.css", "README.md", "LICENSE-APACHE", "LICENSE-MIT", "Cargo.lock"],
    "zdelay-core": ["src/lib.rs", "build.rs", "README.md", "LICENSE-APACHE", "LICENSE-MIT"],
    "zdelay-client": ["src/lib.rs", "README.md", "LICENSE-APACHE", "LICENSE-MIT"],
}
NEVER = re.compile(r"^(target|tests|docs|charts|clients|scripts|deploy|\.github|\.ci|node_modules)/"
                   r"|/node_modules/|\.crate$|\.tgz$")
FIELDS = ["description", "license", "repository", "homepage", "readme", "keywords", "categories"]


def crate_check(crate_file, name, repo_root):
    size = Path(crate_file).stat().st_size
    if size > CRATE_LIMIT:
        fail(f"{crate_file} is {size} bytes, over crates.io's 10 MiB")
    with tarfile.open(crate_file) as t:
        members = t.getmembers()
        prefix = members[0].name.split("/")[0] + "/"
        files = {m.name[len(prefix):]: m for m in members if m.isfile()}
        manifest = tomllib.loads(t.extractfile(prefix + "Cargo.toml").read().decode())
        readme = t.extractfile(prefix + "README.md").read().decode()
    if links := [m for m in members if m.issym() or m.islnk()]:
        fail(f"{name}: links in the package: {[m.name for m in links]}")
    bad = sorted(f for f in files if NEVER.search(f))
    if bad:
        fail(f"{name}: files that do not belong in the crate: {bad[:10]}")
    want = list(MUST[name])
    if name == "zdelay-core":
        # Every Lua script the build expands, shared blocks included.
        lua = Path(repo_root) / "crates/zdelay-core/lua"
        want += [str(p.relative_to(lua.parent)) for p in sorted(lua.rglob("*.lua"))]
    missing = [f for f in want if f not in files]
    if missing:
        fail(f"{name}: missing from the package: {missing}")
    big = [(f, m.size) for f, m in files.items() if m.size > 512 * 1024]
    if big:
        fail(f"{name}: files over 512 KiB (fixtures?): {big}")
    pkg = manifest["package"]
    absent = [f for f in FIELDS if not pkg.get(f)]
    if absent:
        fail(f"{name}: Cargo.toml lacks {absent}")
    if not manifest.get("package", {}).get("metadata", {}).get("docs", {}).get("rs"):
        fail(f"{name}: Cargo.toml lacks [package.metadata.docs.rs]")
    if len(pkg["keywords"]) > 5:
        fail(f"{name}: crates.io takes at most 5 keywords")
    for dep, spec in manifest.get("dependencies", {}).items():
        if isinstance(spec, dict) and "path" in spec:
            fail(f"{name}: dependency {dep} is still a path dependency")
    if "# " not in readme:
        fail(f"{name}: README.md is empty")
    ok(f"{name}: {len(files)} files, {size / 1024:.0f} KiB; metadata {', '.join(FIELDS)}, docs.rs; "
       f"no target/, tests/ or book files; {len(want)} files the build reads present")


def sbom_fix(sbom, unpacked):
    """The SBOM as crates.io users' builds would have it: zdelay and zdelay-core were built from
    their packages unpacked at UNPACKED (a path of the build machine); name them as the
    registry's instead (bom-refs and purls), and no local path is left."""
    text = Path(sbom).read_text()
    prefix = "path+file://" + str(Path(unpacked).resolve()) + "/"
    text = re.sub(re.escape(prefix) + r"[^#\"]*#", "registry+https://github.com/rust-lang/crates.io-index#", text)
    text = re.sub(r"\?download_url=file://[^\"]*", "", text)
    if "file://" in text:
        fail(f"{sbom}: a local path is left: {text[text.index('file://') - 40:][:120]}")
    Path(sbom).write_text(text)


def sbom_check(sbom, lockfile, tree, name, version):
    """TREE: `cargo tree -e normal,build --prefix none` of the binary's package: what it compiles."""
    bom = json.loads(Path(sbom).read_text())
    if bom.get("bomFormat") != "CycloneDX":
        fail(f"{sbom} is not a CycloneDX document")
    top = bom.get("metadata", {}).get("component", {})
    if top.get("name") != name or top.get("version") != version:
        fail(f"{sbom}: describes {top.get('name')} {top.get('version')}, not {name} {version}")
    comps = {(c["name"], c.get("version")) for c in bom.get("components", [])}
    locked = {(p["name"], p["version"]) for p in tomllib.loads(Path(lockfile).read_text())["package"]}
    if wrong := sorted(comps - locked):
        fail(f"{sbom}: components not in Cargo.lock at that version: {wrong[:10]}")
    built = set()
    for line in Path(tree).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].startswith("v"):
            built.add((parts[0], parts[1][1:]))
    built.discard((name, version))
    if len(built) < 100:
        fail(f"{tree}: only {len(built)} crates: not a cargo tree of the daemon")
    if missing := sorted(built - comps):
        fail(f"{sbom}: lacks crates the binary is built from: {missing[:10]}")
    extra = sorted(comps - built)
    nolicense = [c["name"] for c in bom.get("components", []) if not c.get("licenses")]
    ok(f"{Path(sbom).name}: CycloneDX {bom.get('specVersion')}, {name} {version}, {len(comps)} "
       f"components at their Cargo.lock versions, every one of the {len(built)} crates the binary "
       f"is built from among them (and {len(extra)} more that the tool's own feature resolution "
       f"lists and this build does not compile: "
       f"{', '.join(n for n, _ in extra[:6])}{'...' if len(extra) > 6 else ''}); "
       f"{len(nolicense)} without a declared license{': ' + ', '.join(nolicense[:5]) if nolicense else ''}")


def wheel_check(wheel, sdist, version):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(z.read(meta_name).decode())
    for f in ["zdelay/__init__.py", "zdelay/py.typed"]:
        if f not in names:
            fail(f"{wheel}: lacks {f}")
    if not any(n.endswith(("LICENSE-MIT", "LICENSE-APACHE")) for n in names):
        fail(f"{wheel}: carries no license file")
    if [n for n in names if "/tests/" in n or n.startswith("tests/")]:
        fail(f"{wheel}: carries the tests")
    if metadata["Version"] != version:
        fail(f"{wheel}: version {metadata['Version']}, want {version}")
    urls = metadata.get_all("Project-URL") or []
    if not any(u.startswith("Repository") for u in urls):
        fail(f"{wheel}: no Project-URL Repository")
    if not (metadata.get("License-Expression") or metadata.get("License")):
        fail(f"{wheel}: no license in its metadata")
    if not any(r.startswith("redis") for r in metadata.get_all("Requires-Dist") or []):
        fail(f"{wheel}: does not require redis")
    with tarfile.open(sdist) as t:
        snames = t.getnames()
    for f in ["pyproject.toml", "README.md", "LICENSE-MIT", "LICENSE-APACHE", "src/zdelay/__init__.py"]:
        if not any(n.endswith("/" + f) for n in snames):
            fail(f"{sdist}: lacks {f}")
    ok(f"{Path(wheel).name}: {len(names)} files, py.typed, licenses, Requires-Dist redis, "
       f"License {metadata.get('License-Expression') or metadata.get('License')}, "
       f"{len(urls)} project URLs; {Path(sdist).name}: {len(snames)} entries")


def npm_check(tgz, version):
    with tarfile.open(tgz) as t:
        names = [n.removeprefix("package/") for n in t.getnames()]
        pkg = json.loads(t.extractfile("package/package.json").read())
    for f in ["package.json", "README.md", "LICENSE-MIT", "LICENSE-APACHE", "dist/esm/index.js",
              "dist/esm/index.d.ts", "dist/cjs/index.js", "dist/cjs/index.d.ts", "dist/cjs/package.json"]:
        if f not in names:
            fail(f"{tgz}: lacks {f}")
    if bad := [n for n in names if n.startswith(("src/", "test/", "node_modules/"))]:
        fail(f"{tgz}: carries {bad[:5]}")
    if pkg["version"] != version:
        fail(f"{tgz}: version {pkg['version']}, want {version}")
    for field in ["license", "repository", "homepage", "keywords", "description", "exports", "types"]:
        if not pkg.get(field):
            fail(f"{tgz}: package.json lacks {field}")
    ok(f"{Path(tgz).name}: {len(names)} files (ESM, CJS, types, README, licenses); package.json "
       "has license, repository, homepage, keywords, exports, types")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"meta": meta, "notes": notes, "rehearse": rehearse, "sbom-fix": sbom_fix, "crate-check": crate_check, "sbom-check": sbom_check,
     "wheel-check": wheel_check, "npm-check": npm_check}[cmd](*args)
