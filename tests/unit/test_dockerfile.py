"""The top-level Dockerfile pins agree with the project's own.

- its megatron-core and nemo-run pins are setup.py's (install_requires / the `launch` extra);
- its torch satisfies setup.py's and megatron-core's torch requirements, and its
  Transformer-Engine lies in the range megatron-core declares (read from the installed
  megatron-core's metadata, so a megatron-core upgrade that moves the range fails here);
- its SGLang is the version the SGLang engine module targets (`SGLANG_VERSION = "..."` in
  megatron_rl/), once that module exists;
- NVIDIA apex comes from its git repository, never from the unrelated PyPI package `apex`;
- every build arg is used by a build step (an arg nobody reads would be silently ignored).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(REPO, "Dockerfile")


def dockerfile_args() -> dict[str, str]:
    """ARG NAME=default lines of the Dockerfile (quotes stripped)."""
    args = {}
    with open(DOCKERFILE) as f:
        for line in f:
            m = re.match(r"^ARG\s+(\w+)=(.*)$", line.strip())
            if m:
                args[m.group(1)] = m.group(2).strip().strip('"')
    return args


def setup_requirements() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    """install_requires and extras_require of setup.py, read from its source (no build)."""
    with open(os.path.join(REPO, "setup.py")) as f:
        tree = ast.parse(f.read())
    call = next(
        n for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"
    )
    kw = {k.arg: k.value for k in call.keywords}
    install = [Requirement(r) for r in ast.literal_eval(kw["install_requires"])]
    extras = {k: [Requirement(r) for r in v] for k, v in ast.literal_eval(kw["extras_require"]).items()}
    return install, extras


def requirement(reqs: list[Requirement], name: str) -> Requirement:
    found = [r for r in reqs if r.name.lower() == name]
    assert found, f"setup.py declares no `{name}`"
    return found[0]


def exact_pin(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"setup.py `{req}` is not an exact pin"
    return specs[0].version


def test_megatron_core_and_nemo_run_pins_match_setup_py():
    args = dockerfile_args()
    install, extras = setup_requirements()
    assert args["MEGATRON_CORE_VERSION"] == exact_pin(requirement(install, "megatron-core"))
    assert args["NEMO_RUN_VERSION"] == exact_pin(requirement(extras["launch"], "nemo-run"))
    # The image installs the project with the launch extra, so leptonai's cap applies there too.
    with open(DOCKERFILE) as f:
        assert '".[launch]"' in f.read()


def test_torch_satisfies_the_project_and_megatron_core():
    torch_version = dockerfile_args()["TORCH_VERSION"]
    install, _ = setup_requirements()
    assert requirement(install, "torch").specifier.contains(torch_version)
    mcore_torch = requirement([Requirement(r) for r in md.requires("megatron-core")], "torch")
    assert mcore_torch.specifier.contains(torch_version), (torch_version, str(mcore_torch))


def test_transformer_engine_in_megatron_cores_declared_range():
    te = dockerfile_args()["TE_VERSION"]
    assert md.version("megatron-core") == dockerfile_args()["MEGATRON_CORE_VERSION"], (
        "the installed megatron-core is not the one the Dockerfile pins; re-run tools/setup_env.sh"
    )
    reqs = [Requirement(r) for r in md.requires("megatron-core")]
    te_reqs = [r for r in reqs if r.name == "transformer-engine"]
    assert te_reqs, "megatron-core declares no transformer-engine range any more"
    for r in te_reqs:
        assert r.specifier.contains(Version(te), prereleases=True), (te, str(r))


def _engine_sglang_version() -> str | None:
    pat = re.compile(r'^SGLANG_VERSION\s*(?::\s*str)?\s*=\s*"([^"]+)"', re.M)
    for root, _, files in os.walk(os.path.join(REPO, "megatron_rl")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    m = pat.search(f.read())
                if m:
                    return m.group(1)
    return None


def test_sglang_is_the_version_the_engine_targets():
    target = _engine_sglang_version()
    if target is None:
        pytest.skip("no module in megatron_rl/ declares SGLANG_VERSION yet (the SGLang engine)")
    assert dockerfile_args()["SGLANG_VERSION"] == target


def test_apex_is_built_from_nvidia_git_never_pypi():
    with open(DOCKERFILE) as f:
        text = f.read()
    assert "https://github.com/NVIDIA/apex.git" in text
    assert re.fullmatch(r"[0-9a-f]{40}", dockerfile_args()["APEX_COMMIT"])
    for line in text.splitlines():
        if re.search(r"pip install", line) and not line.lstrip().startswith("#"):
            assert not re.search(r"(?<![\w/.-])[\"']?apex([=<>\"' ]|$)", line), line


def test_base_is_ngc_pytorch_and_every_build_arg_is_used():
    args = dockerfile_args()
    assert args["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
    with open(DOCKERFILE) as f:
        body = [ln for ln in f if not ln.lstrip().startswith(("#", "ARG "))]
    text = "".join(body)
    for name in args:
        assert "${" + name + "}" in text, f"build arg {name} is declared but never used"
