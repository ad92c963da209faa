"""The tools that measure a machine for the Burst-Gap model: the csrc/ store-burst probes (probes.py) and
`xstage-dit calibrate` (calibrate.py), which runs them, spawns peer processes and times the kernels, then
fits and writes a calibration. They sit above kernels/ and runtime/, whose code they run; the model and the
planner they feed (burst_gap/) need no GPU."""
