"""Pipeline schedules as an IR: generate, lower, validate, simulate, trace and plot.

The compiler is torch-free C++ (csrc/schedule) behind ``torchpp._schedule``; what it
simulates is what the pipeline runtime executes. Action strings and CSV files follow
torch.distributed.pipelining ("0F3", "1I0", "2W5", "1SEND_F3"), so schedules move between
the two projects.

Example::

    from torchpp import schedule as S
    sch = S.generate("zb-h1", num_ranks=4, num_microbatches=8)
    sch.actions(0)              # ['0F0', '0F1', '0F2', '0F3', '0I0', '0W0', ...]
    sim = S.simulate(sch, f=1.0, i=1.0, w=1.0, comm=0.0)
    sim.bubble_ratio, sim.peak_activations
"""
from torchpp.schedule.schedule import SCHEDULES, Costs, Schedule, ScheduleError, from_csv, generate
from torchpp.schedule.simulation import Simulation, simulate

__all__ = [
    "SCHEDULES",
    "Costs",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "from_csv",
    "generate",
    "simulate",
]
