"""The Dockerfile, read the way scripts/image-check.sh needs it (Python standard library only).

  dockerfile.py plan                 checks the shape: a build stage, the runtime stage's base,
                                     non-root USER, exec-form ENTRYPOINT/CMD, ZDELAY_CONFIG
  dockerfile.py stub-tree DIR        lays out the build stage's files up to the dependency-layer
                                     RUN in DIR (WORKDIR mapped under DIR); prints that RUN
  dockerfile.py final-build          prints the cargo command of the build stage's last RUN,
                                     after checking the files it touches exist
  dockerfile.py dockerignore DEPINFO checks no file the release build read (DEPINFO, cargo's
                                     dep-info) nor any file COPY names is excluded by .dockerignore
  dockerfile.py layout DIR BINARY    the runtime image's files in DIR: every runtime-stage COPY
                                     (build-stage paths: WORKDIR = the repository, others = this
                                     Debian host, the build stage's twin) plus what the base image
                                     ships (its libraries, /etc/passwd); fails when BINARY links a
                                     library neither provides
  dockerfile.py env                  the runtime stage's ENV, one NAME=VALUE a line
  dockerfile.py exec                 ENTRYPOINT + CMD, one argument a line
  dockerfile.py user                 the runtime stage's USER (uid:gid)
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")

# What each runtime base image ships that the binary may rely on. Libraries are sonames the
# base provides (Debian 12 glibc, libgcc, libstdc++, OpenSSL 3); nothing else is assumed —
# time zones and CA certificates must come from the Dockerfile's own COPY lines.
BASES = {
    "gcr.io/distroless/cc-debian12": {
        "libs": {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                 "libresolv.so.2", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
                 "libgcc_s.so.1", "libstdc++.so.6", "libgomp.so.1", "libssl.so.3", "libcrypto.so.3"},
        "passwd": "root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
                  "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
        "group": "root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n",
    },
}


class Fail(Exception):
    pass


def parse(path: str = DOCKERFILE) -> dict:
    """Stages with their instructions; line continuations and comment lines handled."""
    lines, buf = [], ""
    for raw in open(path):
        line = raw.rstrip("\n")
        if re.match(r"^\s*#", line):
            continue  # comments, also between continued lines
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            lines.append(buf.strip())
        buf = ""
    args, stages = {}, []
    for line in lines:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and not stages:
            k, _, v = rest.partition("=")
            args[k] = v
            continue
        if op == "FROM":
            m = re.match(r"^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$", rest, re.I)
            if not m:
                raise Fail(f"cannot read FROM {rest}")
            image = re.sub(r"\$\{?(\w+)\}?", lambda a: args.get(a.group(1), ""), m.group(1))
            stages.append({"from": image, "name": m.group(2), "ops": []})
            continue
        if not stages:
            raise Fail(f"{op} before FROM")
        stages[-1]["ops"].append((op, rest))
    return {"args": args, "stages": stages}


def copy_args(rest: str) -> tuple[str | None, list[str], str]:
    words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    frm = None
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--from="):
            frm = flag[len("--from="):]
        elif not flag.startswith(("--chown=", "--chmod=", "--link")):
            raise Fail(f"COPY flag {flag} is not understood by image-check")
    if len(words) < 2 or (len(words) > 2 and not words[-1].endswith("/")):
        raise Fail(f"COPY {rest}: want sources and one destination (a directory ending in / for several)")
    return frm, words[:-1], words[-1]


def env_pairs(rest: str) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}  # legacy ENV NAME value
    return dict(w.split("=", 1) for w in words)


def stages():
    df = parse()
    st = df["stages"]
    if len(st) < 2:
        raise Fail("the Dockerfile must have a build stage and a runtime stage")
    build = next((s for s in st if s["name"] == "build"), None)
    if build is None:
        raise Fail("no stage named build")
    return build, st[-1]


def workdir(stage) -> str:
    wd = "/"
    for op, rest in stage["ops"]:
        if op == "WORKDIR":
            wd = os.path.join(wd, rest)
    return wd


def last(stage, op):
    vals = [rest for o, rest in stage["ops"] if o == op]
    return vals[-1] if vals else None


def cmd_plan() -> None:
    build, rt = stages()
    if rt["from"].split(":")[0].split("@")[0] not in BASES:
        raise Fail(f"runtime base {rt['from']} is not one image-check knows (BASES in scripts/deploy/dockerfile.py)")
    user = last(rt, "USER")
    if not user or not re.match(r"^[1-9][0-9]*(:[0-9]+)?$", user):
        raise Fail(f"the runtime stage must set a numeric non-root USER (uid:gid), has {user!r}")
    for op in ("ENTRYPOINT", "CMD"):
        v = last(rt, op)
        if not v or not v.startswith("["):
            raise Fail(f"{op} must be in exec form (JSON array): the image has no shell")
    if json.loads(last(rt, "ENTRYPOINT")) != ["/usr/local/bin/zdelay"] or json.loads(last(rt, "CMD")) != ["run"]:
        raise Fail('want ENTRYPOINT ["/usr/local/bin/zdelay"] and CMD ["run"]')
    env = {}
    for op, rest in rt["ops"]:
        if op == "ENV":
            env.update(env_pairs(rest))
    if env.get("ZDELAY_CONFIG") != "/etc/zdelay/zdelay.toml":
        raise Fail("the runtime stage must set ENV ZDELAY_CONFIG=/etc/zdelay/zdelay.toml")
    if any(o == "RUN" for o, _ in rt["ops"]):
        raise Fail("the runtime stage must not RUN anything (no shell there)")
    runs = [r for o, r in build["ops"] if o == "RUN"]
    cargo = [r for r in runs if "cargo build" in r]
    if len(cargo) != 2 or not all("cargo build --release --locked" in r for r in cargo):
        raise Fail("the build stage needs two `cargo build --release --locked` RUNs: the stub dependency layer and the real build")
    print(f"  build stage FROM {build['from']} (WORKDIR {workdir(build)}); runtime FROM {rt['from']}, "
          f"USER {user}, ENTRYPOINT {last(rt, 'ENTRYPOINT')} CMD {last(rt, 'CMD')}")


def context_path(src: str) -> str:
    p = os.path.normpath(os.path.join(ROOT, src))
    if not (p == ROOT or p.startswith(ROOT + os.sep)):
        raise Fail(f"COPY {src} leaves the build context")
    return p


def copy_into(srcs: list[str], dst_root: str, dst: str) -> None:
    """COPY semantics for files and directories (symlinks followed)."""
    target = dst_root + dst
    for src in srcs:
        if os.path.isdir(src):
            shutil.copytree(src, target, symlinks=False, dirs_exist_ok=True)
        else:
            t = os.path.join(target, os.path.basename(src)) if dst.endswith("/") else target
            os.makedirs(os.path.dirname(t), exist_ok=True)
            shutil.copyfile(src, t)
            shutil.copymode(src, t)


def cmd_stub_tree(out: str) -> None:
    build, _ = stages()
    wd = "/"
    for op, rest in build["ops"]:
        if op == "WORKDIR":
            wd = os.path.join(wd, rest)
            os.makedirs(out + wd, exist_ok=True)
        elif op == "COPY":
            frm, srcs, dst = copy_args(rest)
            if frm or "." in srcs:
                raise Fail("the dependency layer must COPY only named files from the context before its RUN")
            dst = dst if dst.startswith("/") else os.path.join(wd, dst) + ("/" if dst.endswith("/") else "")
            copy_into([context_path(s) for s in srcs], out, dst)
        elif op == "RUN" and "cargo build" in rest:
            print(json.dumps({"dir": out + wd, "run": rest}))
            return
    raise Fail("no dependency-layer RUN with cargo build in the build stage")


def cmd_final_build() -> None:
    build, _ = stages()
    runs = [r for o, r in build["ops"] if o == "RUN" and "cargo build" in r]
    final = runs[-1]
    parts = [p.strip() for p in final.split("&&")]
    cargo = parts[-1]
    if cargo != "cargo build --release --locked":
        raise Fail(f"the last build RUN must end with `cargo build --release --locked`, has {cargo!r}")
    for p in parts[:-1]:
        words = shlex.split(p)
        if words[0] != "touch":
            raise Fail(f"image-check runs only the cargo build of the last RUN; it also does {p!r}")
        for f in words[1:]:
            if not os.path.isfile(os.path.join(ROOT, f)):
                raise Fail(f"the last build RUN touches {f}, which does not exist")
    print(cargo)


def ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    pats = []
    path = os.path.join(ROOT, ".dockerignore")
    if not os.path.exists(path):
        return pats
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        p = line[1:] if neg else line
        p = os.path.normpath(p.lstrip("/"))
        rx = ""
        i = 0
        while i < len(p):
            if p.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif p.startswith("**", i):
                rx += ".*"
                i += 2
            elif p[i] == "*":
                rx += "[^/]*"
                i += 1
            elif p[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(p[i])
                i += 1
        pats.append((neg, re.compile("^" + rx + "$")))
    return pats


def ignored(rel: str, pats) -> bool:
    parts = rel.split("/")
    result = False
    for neg, rx in pats:
        # A pattern matching a parent directory excludes everything below it.
        if any(rx.match("/".join(parts[: i + 1])) for i in range(len(parts))):
            result = not neg
    return result


def build_script_inputs() -> set[str]:
    """Each crate's build.rs and the files under the paths it names in
    `cargo:rerun-if-changed=`, relative to the repository."""
    out = set()
    for dirpath, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in ("target", ".git", "node_modules")]
        if "build.rs" not in names or "Cargo.toml" not in names:
            continue
        script = os.path.join(dirpath, "build.rs")
        out.add(os.path.relpath(script, ROOT))
        for path in re.findall(r"cargo:rerun-if-changed=([^\"\s]+)", open(script).read()):
            full = os.path.join(dirpath, path)
            walked = [os.path.join(d, n) for d, _, ns in os.walk(full) for n in ns]
            for f in walked or [full]:
                out.add(os.path.relpath(f, ROOT))
    return out


def cmd_dockerignore(depinfo: str) -> None:
    text = open(depinfo).read().replace("\\\n", " ")
    files = set()
    for line in text.splitlines():
        if ":" not in line:
            continue
        _, _, deps = line.partition(": ")
        for f in re.split(r"(?<!\\) ", deps):
            f = f.replace("\\ ", " ").strip()
            # Files a build script generated under target/ are not in the context; the
            # build script and what it reads are (below).
            if f.startswith(ROOT + "/") and not f.startswith(ROOT + "/target/"):
                files.add(os.path.relpath(f, ROOT))
    files |= build_script_inputs()
    build, rt = stages()
    for stage in (build, rt):
        for op, rest in stage["ops"]:
            if op == "COPY":
                frm, srcs, _ = copy_args(rest)
                if not frm:
                    files |= {os.path.normpath(s) for s in srcs if s != "."}
    if len(files) < 5:
        raise Fail(f"{depinfo} lists only {len(files)} files of the repository")
    pats = ignore_patterns()
    bad = sorted(f for f in files if ignored(f, pats))
    if bad:
        raise Fail(".dockerignore excludes files the image build needs: " + ", ".join(bad))
    print(f"  .dockerignore keeps all {len(files)} files the release build reads or COPY names")


def ldd(binary: str) -> list[tuple[str, str]]:
    res = subprocess.run(["ldd", binary], capture_output=True, text=True)
    if res.returncode != 0:
        raise Fail(f"ldd {binary}: {res.stderr.strip()}")
    out = []
    for line in res.stdout.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line) or re.match(r"\s*(/\S+)\s+\(", line)
        if not m:
            continue
        if m.re.groups == 2:
            name, path = m.group(1), m.group(2)
        else:
            name, path = os.path.basename(m.group(1)), m.group(1)
        if path == "not":
            raise Fail(f"{binary} needs {name}, not found on this host")
        out.append((name, path))
    return out


def cmd_layout(out: str, binary: str) -> None:
    build, rt = stages()
    bwd = workdir(build)
    base = BASES[rt["from"].split(":")[0].split("@")[0]]
    copied = []
    for op, rest in rt["ops"]:
        if op != "COPY":
            continue
        frm, srcs_, dst = copy_args(rest)
        if len(srcs_) != 1:
            raise Fail(f"COPY {rest}: image-check wants one source per runtime COPY")
        src = srcs_[0]
        if frm is None:
            srcs = [context_path(src)]
        elif frm == "build":
            if src == bwd or src.startswith(bwd.rstrip("/") + "/"):
                srcs = [os.path.join(ROOT, os.path.relpath(src, bwd))]
            else:
                srcs = sorted(glob.glob(src))
            if not srcs or not all(os.path.exists(s) for s in srcs):
                raise Fail(f"COPY --from=build {src}: nothing at {srcs or src} on this host (the build stage's twin)")
        else:
            raise Fail(f"COPY --from={frm}: image-check knows the build stage only")
        copy_into(srcs, out, dst)
        copied.append(f"{src} -> {dst}")
    # The base image: its libraries the binary links, its users.
    provided = {os.path.basename(p) for p in glob.glob(out + "/lib/**/*.so*", recursive=True)}
    provided |= {os.path.basename(p) for p in glob.glob(out + "/usr/lib/**/*.so*", recursive=True)}
    missing = []
    for name, path in ldd(binary):
        if name in provided:
            continue
        if name in base["libs"]:
            dst = out + path
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(os.path.realpath(path), dst)
            os.chmod(dst, 0o755)
        else:
            missing.append(name)
    if missing:
        raise Fail(f"the binary links {', '.join(missing)}, which {rt['from']} does not ship and the "
                   "Dockerfile does not copy")
    os.makedirs(out + "/etc", exist_ok=True)
    for f in ("passwd", "group"):
        with open(out + "/etc/" + f, "w") as fh:
            fh.write(base[f])
    print("  runtime files: " + "; ".join(copied))


def cmd_env() -> None:
    _, rt = stages()
    for op, rest in rt["ops"]:
        if op == "ENV":
            for k, v in env_pairs(rest).items():
                print(f"{k}={v}")


def cmd_exec() -> None:
    _, rt = stages()
    for a in json.loads(last(rt, "ENTRYPOINT")) + json.loads(last(rt, "CMD")):
        print(a)


def cmd_user() -> None:
    _, rt = stages()
    print(last(rt, "USER"))


def main() -> int:
    cmd, *args = sys.argv[1:]
    fns = {"plan": cmd_plan, "stub-tree": cmd_stub_tree, "final-build": cmd_final_build,
           "dockerignore": cmd_dockerignore, "layout": cmd_layout, "env": cmd_env,
           "exec": cmd_exec, "user": cmd_user}
    try:
        fns[cmd](*args)
    except Fail as e:
        print(f"  FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
