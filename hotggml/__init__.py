"""hotggml: pinned ggml + a patch series for fused flash-attention training, with tooling.

Modules, one concern each (dependencies point one way):
  pin, patches, gitutil   materialize and verify the pinned ggml; manage the series (no build needed)
  build                   CMake build keyed by pin + series hash
  ffi, graph, ops         cffi binding to the built library
  oracle                  float64 NumPy reference (imports nothing of ours)
  cases, parity, probe,   tools on top of the binding and the oracle
  bench
  cli                     the `hotggml` command
"""

__version__ = "0.1.0"
