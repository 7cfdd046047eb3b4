"""The `reward` section of the config: which verifier scores which data source, the reward
worker pool, and the code verifier's sandbox."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.section import _Section


class SandboxConfig(_Section):
    wall_time_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one program run (one test), in seconds."""
    cpu_time_s: int = Field(5, gt=0)
    """CPU-time limit of one program run, in seconds: of all its processes together where there
    is a cpu cgroup (the run is then killed as a timeout), and of each process (RLIMIT_CPU)."""
    cpu_cores: float = Field(1.0, gt=0)
    """Cores the run's processes may use together (a cpu cgroup's quota, where there is one): a
    program that forks busy children takes no more than this from the trainer's machine."""
    memory_mb: int = Field(512, ge=64)
    """Memory of one program run, in MiB: all its processes together (a cgroup, where there is
    one), each process's address space (RLIMIT_AS), and the size of its /tmp and /dev/shm."""
    max_processes: int = Field(16, ge=1)
    """Processes (threads included) the program may have at once (pids cgroup and RLIMIT_NPROC)."""
    max_file_mb: int = Field(16, gt=0)
    """Largest file the program may write (RLIMIT_FSIZE), in MiB."""
    max_output_kb: int = Field(1024, gt=0)
    """Standard output kept per run; more is cut and the run fails as output_limit."""
    max_open_files: int = Field(1024, ge=32)
    """Descriptors each process of the program may hold (RLIMIT_NOFILE): without a limit one run
    could hold a large share of the machine's fs.file-max, which every process shares."""
    compile_time_s: float = Field(15.0, gt=0)
    """Wall-clock limit of compiling a C++ solution (its CPU limit too, rounded up)."""
    compile_memory_mb: int = Field(2048, ge=256)
    """Memory of compiling a C++ solution, in MiB, and the size of the compiler's /tmp (g++ on
    a template-heavy file needs far more than the program it builds; the run itself gets
    memory_mb)."""
    syscall_filter: bool = True
    """Run programs under the seccomp filter (no keyrings, ptrace, mounts, new user namespaces,
    bpf, io_uring and AIO, inotify, vsock, ...; asyncrl/reward/sandbox/seccomp.py), where this machine allows one.
    false: only for programs that need a refused call; each run still gets a fresh session
    keyring, and its uid's keyrings are cleared after it."""
    backend: Literal["auto", "namespaces", "bwrap"] = "auto"
    """How runs are isolated: auto (the kernel's namespaces directly, else bubblewrap if installed,
    else what is left, logged at start), or one of them first (bwrap costs ~10 ms more per run)."""


class CodeRewardConfig(_Section):
    mode: Literal["all_pass", "fraction"] = "all_pass"
    """all_pass: 1 only if every test passes (Ring-lite, Skywork-OR1); fraction: passed / total (ProRL)."""
    float_tolerance: float | None = Field(None, ge=0)
    """Standard-output and call tests: an expected real number matches any number within this
    absolute/relative tolerance (None: exact). Integers compare exactly either way, or a relative
    tolerance would pass 10**9 for 1000000007."""
    max_tests: int = Field(32, ge=1)
    """At most this many tests per sample are run (the first ones)."""
    sandbox: SandboxConfig = SandboxConfig()
    """Resource limits of each run."""


class RewardConfig(_Section):
    type: str | None = "math_verify"
    """Default verifier, for samples whose data_source is not in by_source: math_verify, code,
    answer_tag, multiple_choice, or `import:package.module:function` (a user reward function).
    None: every data source must be listed in by_source (checked against the data at start)."""
    by_source: dict[str, str] = {}
    """data_source (or domain) -> verifier name, e.g. {codecontests: code, gpqa: multiple_choice}."""
    num_workers: int = Field(2, ge=1)
    """Reward worker processes; rewards are computed there while generation goes on."""
    placement: Literal["driver", "actor"] = "driver"
    """Where training samples are scored: "driver" (one pool of num_workers beside the
    orchestrator) or "actor" (each rollout actor runs a pool of num_workers beside its engine and
    sends its samples scored: verifier capacity grows with the actors and the driver only ingests;
    evaluation samples are still scored on the driver)."""
    timeout_s: float = Field(30.0, gt=0)
    """Hard limit per sample: a verifier still running is killed, the sample gets reward 0."""
    code: CodeRewardConfig = CodeRewardConfig()
    """The code verifier and its sandbox."""
    import_path: list[str] = []
    """Directories searched first for the modules of `import:` reward functions. When a recipe does
    not say, loading it fills in its directory and the working directory, so the reward workers, the
    actors and the offline tools (which load the run's config.yaml) import the module the run did."""
    max_error_frac: float = Field(0.01, ge=0, le=1)
    """Stop the run (exit 1) when more than this fraction of the scored samples make the verifier
    raise or return something that is not a reward, judged with confidence: from 10 errors on,
    when the error rate's 3-sigma lower bound is above it. 1 never stops. Each distinct error's
    first traceback is printed and logged either way."""

    @field_validator("type")
    @classmethod
    def _known_default(cls, v: str | None) -> str | None:
        if v is not None:
            _check_verifier_name(v)
        return v

    @field_validator("by_source")
    @classmethod
    def _known_routes(cls, v: dict[str, str]) -> dict[str, str]:
        for source, name in v.items():
            _check_verifier_name(name, f"data source {source!r}: ")
        return v

    @model_validator(mode="after")
    def _one_run_fits_the_timeout(self) -> RewardConfig:
        # the code verifier stops starting tests when the next could outlast timeout_s (so a sample
        # keeps the tests it passed), but one compile plus one run must fit, or every slow
        # solution is killed by the pool and loses everything
        if "code" in (self.type, *self.by_source.values()):
            sb = self.code.sandbox
            if sb.compile_time_s + sb.wall_time_s >= self.timeout_s:
                raise ValueError(f"reward.code.sandbox.compile_time_s + wall_time_s ({sb.compile_time_s} + "
                                 f"{sb.wall_time_s}) must be below reward.timeout_s ({self.timeout_s})")
        return self


BUILTIN_VERIFIERS = ("math_verify", "code", "answer_tag", "multiple_choice", "episode")


def _check_verifier_name(name: str, where: str = "") -> None:
    if name in BUILTIN_VERIFIERS:
        return
    if name.startswith("import:") and ":" in name[len("import:"):]:
        return
    raise ValueError(f"{where}unknown verifier {name!r} (allowed: {', '.join(BUILTIN_VERIFIERS)}, "
                     "or import:package.module:function)")
