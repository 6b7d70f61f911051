"""Process primitives of a run: a child that dies with its parent and logs to its own file
(``children``), process titles (``proctitle``) and the engine thread's CPU policy
(``cpu_policy``). ``fastkv.launch`` builds a run from them; the supervisor program
(``fastkv.cli.supervisor``) watches one."""
