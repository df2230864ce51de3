"""The real Amplifier command line, installed for end-to-end tests.

The host's sources are the archives in ``../shared/amplifier-host/`` next to the repository
(``$CONTEXT_PERSISTENT_AMPLIFIER_HOST`` overrides the folder): amplifier-app-cli, amplifier-foundation and
amplifier-module-loop-basic, plus amplifier-core 2.0.2 from the package index. ``build_host`` installs
them, and this package, into a separate virtual environment under a temporary folder, with the small
provider, tool and hook modules in ``tests/amplifier_host/modules`` put on that environment's path. Nothing
is written outside the temporary folder: the pip cache, the wheels, the package's build copy and every HOME live there.

Where the archives are absent (a user's clone) the tests skip with the reason; with
``CONTEXT_PERSISTENT_REQUIRE_AMPLIFIER_HOST=1`` (set by ``.ci/run``) that skip is a failure.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODULES = Path(__file__).resolve().parent / "amplifier_host" / "modules"
HOST_ENV = "CONTEXT_PERSISTENT_AMPLIFIER_HOST"
REQUIRE_ENV = "CONTEXT_PERSISTENT_REQUIRE_AMPLIFIER_HOST"
ARCHIVES = ("amplifier-app-cli", "amplifier-foundation", "amplifier-module-loop-basic")
CORE = "amplifier-core==2.0.2"
#: What of the repository goes into the build copy that is installed into the host's environment.
PACKAGE_FILES = ("pyproject.toml", "README.md", "LICENSE", "context_persistent", "amplifier_module_context_persistent")


def host_dir() -> Path:
    return Path(os.environ.get(HOST_ENV) or ROOT.parent / "shared" / "amplifier-host")


class HostUnavailable(Exception):
    """The archives are not there."""


def unavailable(reason: str) -> None:
    """Skip, or fail when CI requires the real host."""
    import pytest

    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"the real Amplifier host is required ({REQUIRE_ENV}=1) but {reason}", pytrace=False)
    pytest.skip(reason)


def find_archives(folder: Path, names: tuple[str, ...] = ARCHIVES) -> dict[str, Path]:
    """The source archives ``names`` (the three of the CLI by default) in ``folder``; HostUnavailable (with
    the reason) if any is missing."""
    if not folder.is_dir():
        raise HostUnavailable(f"no Amplifier host archives at {folder} (set {HOST_ENV} to their folder)")
    found: dict[str, Path] = {}
    for name in names:
        matches = sorted(folder.glob(f"{name}-*.tar.gz"))
        if len(matches) != 1:
            raise HostUnavailable(f"expected one {name}-<commit>.tar.gz in {folder}, found {len(matches)}")
        found[name] = matches[0]
    return found


@dataclass
class Host:
    """The installed CLI: its environment, the test modules, and the package's build copy."""

    base: Path
    venv: Path
    package: Path
    modules: Path
    wheels: Path
    install_seconds: float

    @property
    def amplifier(self) -> Path:
        return self.venv / "bin" / "amplifier"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def _run(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")


def build_host(base: Path, *, install_package: bool = True, extra: tuple[str, ...] = (),
               wheels: Path | None = None, more_archives: tuple[str, ...] = ()) -> Host:
    """Install the real CLI and this package into ``base/venv`` (8-11 s on 2 cores).

    ``install_package=False`` leaves this package out (a mount plan's ``source:`` must then install it);
    ``extra`` names more requirements from the index (e.g. ``uv``, which the CLI's module activator runs).
    Everything is first built or fetched as wheels into ``base/wheels`` (the archives built once), then
    installed from there alone, without compiling bytecode (``Cli`` runs write it for what they import). The
    local projects (the archives and this package) are built first, without their dependencies, in one build
    environment, ``base/build``, holding the build requirements their ``pyproject.toml`` files declare (pip's
    own isolation installs them again for every project: 2-3 s more on 2 cores);
    ``wheels`` names the folder of an earlier host to install from instead (only this host's ``extra`` and
    package are then fetched or built). ``more_archives`` names more archives of the host folder to install
    (e.g. ``amplifier-module-context-simple``, for the benchmark).
    """
    archives = find_archives(host_dir(), ARCHIVES + more_archives)
    started = time.monotonic()
    src = base / "src"
    src.mkdir(parents=True)
    sources = []
    for name, archive in archives.items():
        with tarfile.open(archive) as tar:
            safe: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(src / archive.name.removesuffix(".tar.gz"), **safe)
        roots = [p.parent for p in (src / archive.name.removesuffix(".tar.gz")).glob("*/pyproject.toml")]
        if len(roots) != 1:
            raise RuntimeError(f"{archive}: expected one project folder with a pyproject.toml, found {roots}")
        sources.append(str(roots[0]))
    package = base / "package"
    package.mkdir()
    for name in PACKAGE_FILES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, package / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, package / name)
    home = base / "install-home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    venv = base / "venv"
    # No pip of its own (the CLI never runs pip; uv installs modules): this interpreter's pip installs into it.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, 120)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    own = [str(package)] if install_package else []
    fresh = wheels is None  # (else only this host's package and extra are built or fetched)
    local = [*sources, *own] if fresh else own
    wheels = base / "wheels" if wheels is None else wheels
    cache = ["--cache-dir", str(wheels.parent / "pip-cache")]
    built: list[str] = []
    if local:
        build = base / "build"
        _run([sys.executable, "-m", "venv", "--without-pip", str(build)], env, 120)
        build_pip = [sys.executable, "-m", "pip", "--python", str(build / "bin" / "python")]
        _run([*build_pip, "install", "--quiet", *cache, *build_requirements(local)], env, 600, cwd=base)
        _run([*build_pip, "wheel", "--quiet", "--no-build-isolation", "--no-deps", *cache,
              "--wheel-dir", str(base / "built"), *local], env, 600, cwd=base)
        built = sorted(str(p) for p in (base / "built").glob("*.whl"))
    # The built wheels and what they need (from the index, sdists built in pip's isolated environments), into wheels.
    fetch = [*([CORE] if fresh else []), *built, *extra]
    if fetch:
        _run([*pip, "wheel", "--quiet", *cache, "--wheel-dir", str(wheels), *fetch], env, 600, cwd=base)
    _run([*pip, "install", "--quiet", "--no-index", "--no-compile", "--find-links", str(wheels), CORE, *ARCHIVES,
          *more_archives,
          *(["context-persistent"] if install_package else []), *extra], env, 600, cwd=base)
    modules = base / "modules"
    shutil.copytree(MODULES, modules, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "cp_e2e_modules.pth").write_text("".join(f"{p}\n" for p in sorted(modules.iterdir())))
    return Host(base=base, venv=venv, package=package, modules=modules, wheels=wheels,
                install_seconds=time.monotonic() - started)


def build_requirements(projects: list[str]) -> list[str]:
    """The build requirements (``[build-system] requires``) the ``pyproject.toml`` of each project folder
    declares, each once, in order; a project that declares none is an error (pip would assume setuptools)."""
    import tomllib

    found: list[str] = []
    for folder in projects:
        with open(Path(folder) / "pyproject.toml", "rb") as f:
            requires = tomllib.load(f).get("build-system", {}).get("requires")
        if not requires:
            raise RuntimeError(f"{folder}/pyproject.toml declares no [build-system] requires")
        found += [r for r in requires if r not in found]
    return found


def run_folder(tmp_path_factory: Any) -> Path:
    """A folder of this pytest run that every pytest-xdist worker of the run shares: the parent of the
    worker's basetemp (``pytest-N/popen-gwK``) under xdist, the basetemp itself without it."""
    base = Path(tmp_path_factory.getbasetemp())
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_host(tmp_path_factory: Any) -> Host:
    """The real CLI installed once per pytest run, for every test file and xdist worker that needs it.

    The first caller builds it into ``run_folder()/amplifier-host`` under an exclusive lock and records it
    in ``host.json`` there; later callers (another file's session fixture, another worker) wait for the lock
    and take the recorded host. A build that failed half-way is removed and tried again by the next caller.
    The tests only run the CLI in the host (each in its own HOME and folders) and read its wheels, so they
    can share it; a test that changes an environment builds its own (test_amplifier_cli's ``bare`` host).
    """
    try:
        find_archives(host_dir())
    except HostUnavailable as e:  # a skip, or a failure where CI requires the host
        unavailable(str(e))
    folder = run_folder(tmp_path_factory) / "amplifier-host"
    record = folder / "host.json"
    fd = os.open(folder.with_name("amplifier-host.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if record.exists():
            fields = json.loads(record.read_text())
            return Host(**{k: (v if k == "install_seconds" else Path(v)) for k, v in fields.items()})
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700)
        host = build_host(folder)
        fields = {k: (v if k == "install_seconds" else str(v)) for k, v in vars(host).items()}
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps(fields))
        os.chmod(tmp, 0o600)
        tmp.replace(record)
        return host
    finally:
        os.close(fd)  # (releases the lock)


def bundle_text(host: Host, storage: Path, *, context_source: bool = True, delegate: bool = False,
                instruction: str = "You are the test agent.") -> str:
    """A bundle for the tests. The context section is the mount plan docs/amplifier.md documents."""
    source = f"\n    source: {host.package}" if context_source else ""
    tools = ["tool-echo"] + (["tool-delegate"] if delegate else [])
    tool_lines = "".join(f"  - module: {t}\n    source: {host.modules / t}\n" for t in tools)
    return (
        "---\n"
        "bundle:\n  name: cp-e2e\n  version: 0.1.0\n"
        "session:\n"
        "  orchestrator:\n    module: loop-basic\n"
        f"  context:\n    module: context-persistent{source}\n"
        f"    config:\n      storage_path: {storage}\n"
        "providers:\n"
        f"  - module: provider-scripted\n    source: {host.modules / 'provider-scripted'}\n"
        "hooks:\n"
        f"  - module: hooks-session-dir\n    source: {host.modules / 'hooks-session-dir'}\n"
        f"tools:\n{tool_lines}"
        "---\n"
        f"{instruction}\n"
    )


@dataclass
class Cli:
    """One test's world: its own HOME, project folder (the CLI's cwd), store and provider record."""

    host: Host
    root: Path
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = self.root / "home"
        self.project = self.root / "project"
        self.storage = self.root / "store"
        self.requests_path = self.root / "requests.jsonl"
        self.marker = self.root / "tool-started"
        self.bundle = self.root / "bundle" / "bundle.md"
        for d in (self.home / ".amplifier", self.project, self.bundle.parent):
            d.mkdir(parents=True, exist_ok=True)
        (self.home / ".amplifier" / "settings.yaml").write_text(
            "config:\n  providers:\n"
            f"    - module: provider-scripted\n      source: {self.host.modules / 'provider-scripted'}\n"
            "      config: {}\n")
        self.write_bundle()
        # The host is installed without bytecode: its first run writes the bytecode of what it imports, into
        # the host's environment (in the temporary folder), for the runs after it.
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "PYTHONPATH", "CONTEXT_PERSISTENT_DIR", "PYTHONDONTWRITEBYTECODE")}
        env.update({
            "HOME": str(self.home),
            "PATH": f"{self.host.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "CP_E2E_PROVIDER_LOG": str(self.requests_path),
            "CP_E2E_TOOL_MARKER": str(self.marker),
            # Offline, the CLI's add-ons from GitHub fail at once instead of after three retries.
            "AMPLIFIER_GIT_CLONE_TIMEOUT_S": "0.01",
            "NO_COLOR": "1",
            "PYTHONFAULTHANDLER": "1",  # a crash at exit says where it happened (see host_exit_crash)
            "COLUMNS": "200",
            "TERM": "dumb",
        })
        self.env = env

    def write_bundle(self, **kwargs: Any) -> None:
        self.bundle.write_text(bundle_text(self.host, self.storage, **kwargs))

    @property
    def bundle_uri(self) -> str:
        return f"file://{self.bundle}"

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.host.amplifier), *args], cwd=self.project, env=self.env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0 and not host_exit_crash(proc):
            raise AssertionError(f"amplifier {' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                                 f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
        return proc

    def popen(self, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([str(self.host.amplifier), *args], cwd=self.project, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)

    # -- what the provider received ---------------------------------------------------------------
    def requests(self, session_id: str | None = None) -> list[list[dict[str, Any]]]:
        if not self.requests_path.exists():
            return []
        out = []
        for line in self.requests_path.read_text().splitlines():
            record = json.loads(line)
            if session_id is None or record["session_id"] == session_id:
                out.append(record["messages"])
        return out

    def request_sessions(self) -> list[str]:
        if not self.requests_path.exists():
            return []
        return [json.loads(line)["session_id"] for line in self.requests_path.read_text().splitlines()]

    # -- the CLI's own session files --------------------------------------------------------------
    def sessions_dir(self) -> Path:
        found = list((self.home / ".amplifier" / "projects").glob("*/sessions"))
        assert len(found) == 1, found
        return found[0]

    def transcript(self, session_id: str) -> list[dict[str, Any]]:
        path = self.sessions_dir() / session_id / "transcript.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    # -- our log, read-only -----------------------------------------------------------------------
    def log_messages(self, session_id: str) -> list[dict[str, Any]]:
        from context_persistent import PersistentContextManager
        async def read() -> list[dict[str, Any]]:
            store = await PersistentContextManager.open(storage_path=self.storage, session_id=session_id,
                                                        readonly=True)
            try:
                return await store.get_messages()
            finally:
                await store.close()

        return asyncio.run(read())

    def log_records(self, session_id: str) -> list[dict[str, Any]]:
        from context_persistent.storage.log import FileEventLog
        from context_persistent.storage.paths import session_dir

        async def read() -> list[dict[str, Any]]:
            log = FileEventLog(session_dir(self.storage, session_id), session_id, readonly=True)
            try:
                return [r async for batch in log.read_batches() for r in batch]
            finally:
                await log.close()

        return asyncio.run(read())


def host_exit_crash(proc: subprocess.CompletedProcess[str]) -> bool:
    """The CLI died of the host's crash at interpreter exit, after its command had done its work.

    amplifier-core 2.0.2 sometimes aborts while Python finalises ("PyGILState_Release: thread state ... must
    be current when releasing", "Python runtime state: finalizing"), or aborts or segfaults there in a thread
    running no Python code. It happens with an in-memory context module too (about 1 exit in 30 on a busy
    2-core machine), so it is the host's; the tests go on to check what was received and logged.
    """
    err = proc.stderr or ""
    if proc.returncode == -signal.SIGABRT:
        return "Python runtime state: finalizing" in err or _no_python_frame(err, "Fatal Python error: Aborted")
    if proc.returncode in (-signal.SIGSEGV, -signal.SIGBUS):
        return _no_python_frame(err, "Fatal Python error: Segmentation fault") or _report_cut_short(err)
    return False


def _report_cut_short(err: str) -> bool:
    """The fault handler's report of a segfault was itself cut short by a second fatal error (a bus error while
    it walked the threads of a finalising interpreter, exit status SIGBUS) before it showed any Python frame
    (seen once in some 250 CLI exits of a suite run, 2026-11-28, after the command had printed its reply)."""
    fatal = "Fatal Python error: Segmentation fault"
    if fatal not in err:
        return False
    after = err.split(fatal, 1)[1]
    return "Fatal Python error:" in after and "File \"" not in after.split("Fatal Python error:", 1)[0]


def _no_python_frame(err: str, fatal: str) -> bool:
    """The fault handler's report ``fatal`` shows no Python frame in any thread: native code crashed."""
    return fatal in err and "<no Python frame>" in err and "File \"" not in err.split(fatal, 1)[1]


SESSION_ID = re.compile(r"Session ID:\s*([0-9a-f-]{36})")


def session_id_of(output: str) -> str:
    match = SESSION_ID.search(output)
    assert match, f"no session id in the CLI's output:\n{output[-2000:]}"
    return match.group(1)


# -- what every request must look like ------------------------------------------------------------
def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return " ".join(str(b.get("text") or b.get("output") or "") for b in content or [] if isinstance(b, dict))


def tool_calls_of(message: dict[str, Any]) -> list[str]:
    """The ids of the tool calls an assistant message in a request makes (as content blocks or a list)."""
    ids = [b["id"] for b in message.get("content") or [] if isinstance(b, dict) and b.get("type") == "tool_call"]
    ids += [c.get("id") for c in message.get("tool_calls") or []]
    return [i for i in ids if i]


def check_request(messages: list[dict[str, Any]], *, repeats: bool = False) -> list[str]:
    """Problems with one request: not exactly one system prompt (first), unpaired tool calls or results,
    a user turn sent twice (unless ``repeats``: the test typed the same words twice)."""
    problems = []
    roles = [m["role"] for m in messages]
    systems = [i for i, r in enumerate(roles) if r == "system"]
    if systems != [0]:
        problems.append(f"system messages at {systems} (want exactly one, first) in roles {roles}")
    open_calls: list[str] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m.get("tool_call_id") not in open_calls:
                problems.append(f"tool result {m.get('tool_call_id')} at {i} answers no open call {open_calls}")
            else:
                open_calls.remove(m["tool_call_id"])
            continue
        if open_calls:
            problems.append(f"tool calls {open_calls} unanswered before message {i} ({m['role']})")
            open_calls = []
        if m["role"] == "assistant":
            open_calls = tool_calls_of(m)
    users = [text_of(m) for m in messages if m["role"] == "user"]
    repeated = sorted({u for u in users if users.count(u) > 1})
    if repeated and not repeats:
        problems.append(f"user turns sent more than once: {repeated}")
    return problems


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [text_of(m) for m in messages if m["role"] == "user"]
