"""autopipe's runtime: the stage tasks, and the transports that run them under a schedule (autopipe/ir/schedule.py);
it imports nothing of the passes, only autopipe/ir."""
