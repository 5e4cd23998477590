"""Plain data for one recorded run (ops, module calls, traces, forks) and its replay."""
