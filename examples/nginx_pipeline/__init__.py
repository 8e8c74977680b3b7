"""The nginx access-log pipeline on Spark: generate, aggregate in a stream, print.

``python -m examples.nginx_pipeline`` (what ``make run`` executes) starts a local cluster
(``tidelog dev``), runs the three steps - ``generator``, ``stream_job``, ``report`` - in
one Spark ``local[2]`` session, and stops the cluster.
"""
