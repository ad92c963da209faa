"""Importing this builds every tiny pipeline of the zoo once. A process that forks ranks (the test harness's fork
server) imports it first: the lazy imports a first build triggers in diffusers, transformers and peft (seconds of
CPU) then happen once there instead of in every forked rank."""
from . import zoo

for _name in zoo.ZOO:
    if _name.startswith("tiny-"):
        zoo.build_pipeline(_name)
