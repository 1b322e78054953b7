"""autopipe's runtime: schedules, the stage tasks, and the transports that run them."""
