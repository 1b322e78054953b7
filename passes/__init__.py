"""autopipe's compiler passes: trace -> cost -> partition -> codegen, one file and entry function each; none imports the
runtime."""
