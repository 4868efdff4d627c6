"""The course's last stage, learning from preferences and rewards: tasks whose answers a program checks."""
