"""The engine thread: sequences, the values that cross the thread boundary, the scheduler (the
one writer of a sequence's pages and counts), the preemption policy, parking, speculation."""
