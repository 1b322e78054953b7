"""autopipe's compiler passes: trace -> micro-batch analysis -> cost -> partition -> codegen, one entry function and
typed result each (docs/architecture.md, "Reading order"); none imports the runtime, only autopipe/ir."""
