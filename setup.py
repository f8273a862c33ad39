"""pdd: an SGLang add-on for cross-datacenter prefill-decode disaggregation.

kernels/, eval/ and launch/ are top-level folders in the repository but are installed as
pdd.kernels, pdd.eval and pdd.launch so they never claim generic top-level names.
"""

from setuptools import find_packages, setup

FOLDERS = {"pdd.kernels": "kernels", "pdd.eval": "eval", "pdd.launch": "launch"}


def packages() -> list[str]:
    """pdd's packages and those of each top-level folder, under their installed names."""
    found = find_packages(include=["pdd", "pdd.*"])
    for name, folder in FOLDERS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


# The same pins as requirements/cpu.txt for the packages pdd itself imports.
COMMON = [
    "sglang==0.5.23",
    "pyzmq==27.3.0",
    "msgpack==1.2.4",
    "triton==3.8.0",
    "sglang-router==0.3.2",
    "kubernetes-validate==1.37.0",  # pdd.launch.k8s checks what it renders
]

setup(
    name="pdd",
    version="0.1.0",
    description="Cross-datacenter heterogeneous prefill-decode disaggregation for SGLang",
    python_requires=">=3.10",
    packages=packages(),
    package_dir={"pdd": "pdd", **FOLDERS},
    install_requires=COMMON,
    extras_require={
        # Mooncake's CPU build (TCP only) and its CUDA build (RDMA + TCP).
        "cpu": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        "gpu": ["mooncake-transfer-engine==0.3.13.post1"],
        "test": ["pytest==9.2.0", "requests==2.34.2", "hypothesis==6.170.17"],
    },
    entry_points={"sglang.srt.plugins": ["pdd = pdd.srt.plugin:load"]},
)
