"""Attribution: every inter-token gap and every TTFT partitioned exclusively by cause.

`timeline` (the shared kernel: elementary intervals, compensated cumulative sums, and
`PreparedRun`, what every partition of one run derives from its log, derived once) <
`itl` (inter-token gaps) < `ttft` (time to first token) < `client` (the client boundary of
a merged server run) < `reference` (the three again as slow loops, for the tests).
"""
