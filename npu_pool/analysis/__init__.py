"""See where the memory goes: peak breakdown, static estimates, reports, memory_viz export.

Modules (import what you need; none imports torch):

- :mod:`.phases`     what the phase markers say about an event (iteration, forward, layer ...)
- :mod:`.breakdown`  one pass over a trace: peak live, bytes by category, sites, per-layer deltas
- :mod:`.report`     the analysis of one trace or many ranks, as Markdown or JSON
- :mod:`.html`       the same as one self-contained HTML page
- :mod:`.estimate`   static memory estimate from a model config, compared with a trace
- :mod:`.memviz`     PyTorch memory snapshot pickles that ``torch.cuda._memory_viz`` opens

OOM snapshots and the explanation of an out-of-memory error are :mod:`npu_pool.oom`.
"""
