"""The recorder's step pipeline (:class:`gradlog.GradRecorder` is its facade).

One module per job: :mod:`~gradlog.recording.pipeline` wires the stages of a recorded
backward call; :mod:`~gradlog.recording.lifecycle` numbers steps and commits them
(:mod:`~gradlog.recording.state` holds the step in progress); :mod:`~gradlog.recording.inputs`
checks what a call is given; :mod:`~gradlog.recording.selfcheck` verifies
``sum_b w_b g_b == p.grad``; :mod:`~gradlog.recording.probes` records held-out examples;
:mod:`~gradlog.recording.encoding` plans and applies the forms;
:mod:`~gradlog.recording.staging` brings arrays to host memory in their storage dtype;
:mod:`~gradlog.recording.handoff` opens the store writer (root attributes, parameter specs).
"""
