"""Compiled programs read and measured: what a step holds per device and where
(stats, buffers), what it executes (hlo_work, hlo_schedule), ahead-of-time
compiles for absent chips (aot), timing (measure) and the memory-budget
search that uses them (budget)."""
