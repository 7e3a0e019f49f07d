"""Lockgate: a multi-tenant LLM gateway and the inference engine behind it.

Everything the distribution installs lives under this one name, so that it sits beside other
distributions (Hugging Face's `kernels`, which transformers needs, is a top-level `kernels`):
`lockgate.engine`, `lockgate.kernels`, `lockgate.tenancy`, `lockgate.gateway`,
`lockgate.migrations` and the benchmarks, `lockgate.loadtests`. In the repository the
subpackages are the top-level folders; `lockgate/` links them into the namespace.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("lockgate")
except _metadata.PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"
