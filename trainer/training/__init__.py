"""Online training: the loop, its distributed setup and its shutdown (signals, stall watchdog)."""
