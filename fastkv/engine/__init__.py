"""Engine process loop, worker protocol and reference runners."""
