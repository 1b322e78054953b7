"""autopipe's compiler passes: trace -> cost -> partition -> codegen. Each pass is one file
with one entry function and a typed result; none imports the runtime."""
