"""Elastic cluster scheduling: traces, job models, a simulator and policies (ONES + baselines).

Typical use::

    models = JobModels.fit(default_profile_dir())
    jobs = load_trace("workload-1.csv", max_gpus=64, apps=models.names)
    result = Simulator(jobs, ClusterSpec.with_gpus(64), models).run(make_policy("ones"))
"""

from tessera.cluster.job_model import AppModel, JobModels
from tessera.cluster.policies import POLICIES, ClusterSpec, Policy, make_policy
from tessera.cluster.profiles import default_profile_dir
from tessera.cluster.simulator import SchedulingError, SimConfig, SimResult, Simulator
from tessera.cluster.traces import JobSpec, TraceError, assign_philly_apps, load_trace

__all__ = ["AppModel", "JobModels", "POLICIES", "ClusterSpec", "Policy", "make_policy",
           "default_profile_dir", "SchedulingError", "SimConfig", "SimResult", "Simulator",
           "JobSpec", "TraceError", "assign_philly_apps", "load_trace"]
