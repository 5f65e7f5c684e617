# `nix run` wrapper of a rollkv-llamafile build: nix/launcher.sh with the program and the
# CUDA switch filled in (finds the host's libcuda.so.1 outside NixOS; explains a missing model).
{
  lib,
  writeShellApplication,
  llamafile,
  program ? "llama-server",
}:
writeShellApplication {
  name = "rollkv-${program}";
  text = ''
    ROLLKV_PROGRAM=${llamafile}/bin/${program}
    ROLLKV_CUDA=${if llamafile.passthru.cudaSupport then "1" else "0"}
  ''
  + builtins.readFile ./launcher.sh;
}
