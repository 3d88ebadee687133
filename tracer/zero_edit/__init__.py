"""Zero-edit tracing (``tracer run`` and :func:`tracer.watch`): a training script runs unmodified
(:mod:`~tracer.zero_edit.script_runner`) while a watcher (:mod:`~tracer.zero_edit.watch`) reads the
fields of each backward from the loop's own variables (:mod:`~tracer.zero_edit.frames`,
:mod:`~tracer.zero_edit.frame_lookup`), named by a map (:mod:`~tracer.zero_edit.name_maps`, the bundled
``maps/*.toml``) and planned once per call site (:mod:`~tracer.zero_edit.site_plans`), numbered by
:mod:`~tracer.zero_edit.step_clock`, and hands each captured step to :mod:`tracer.record`.
"""
