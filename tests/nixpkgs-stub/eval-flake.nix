# Test fixture: evaluate a checkout's flake.nix outputs against this stand-in
# for nixpkgs and return plain data about them (JSON-able).
#   nix-instantiate --eval --strict --json --readonly-mode eval-flake.nix --arg repo /path/to/checkout
{
  repo,
  system ? "x86_64-linux",
}:
let
  stubPkgs = import ./. { inherit system; };
  nixpkgs = {
    outPath = toString ./.;
    lib = import ./lib.nix;
    legacyPackages.${system} = stubPkgs;
  };
  flake = import (repo + "/flake.nix");
  outputs = flake.outputs { inherit self nixpkgs; };
  self = outputs // {
    outPath = "/nix/store/00000000000000000000000000000000-source";
  };
  names = map (d: d.name);
  llamafile = p: {
    inherit (p)
      pname
      version
      sourceRoot
      cmakeFlags
      stdenvName
      postPatch
      postInstall
      installPhase
      ninjaFlags
      system
      ;
    src = p.src.fetchPypiArgs;
    patches = map (x: baseNameOf (toString x)) p.patches;
    nativeBuildInputs = names p.nativeBuildInputs;
    buildInputs = names p.buildInputs;
    meta = {
      inherit (p.meta) mainProgram description platforms;
      license = p.meta.license.spdxId;
    };
    passthru = {
      inherit (p.passthru) seriesNames cudaSupport buildCommit;
      pin = p.passthru.pin;
    };
    storePath = p.outPath;
  };
  pkgs = outputs.packages.${system};
  shell = outputs.devShells.${system}.default;
in
{
  inherit (flake) description;
  nixpkgsUrl = flake.inputs.nixpkgs.url;
  systems = builtins.attrNames outputs.packages;
  packageNames = builtins.attrNames pkgs;
  default = llamafile pkgs.default;
  cpu = llamafile pkgs.cpu;
  cuda = llamafile pkgs.cuda;
  rollkv = {
    inherit (pkgs.rollkv) text;
    runtimeInputs = names pkgs.rollkv.runtimeInputs;
    runtimeOutPaths = map (d: d.outPath) pkgs.rollkv.runtimeInputs;
  };
  apps = outputs.apps.${system};
  gates = {
    inherit (pkgs.gates) text;
    runtimeOutPaths = map (d: d.outPath) pkgs.gates.runtimeInputs;
  };
  server = {
    inherit (pkgs.server) text name;
    storePath = pkgs.server.outPath;
  };
  serverCpu = {
    inherit (pkgs.server-cpu) text name;
    storePath = pkgs.server-cpu.outPath;
  };
  llamaTree = {
    inherit (pkgs.llama-tree) srcOnlyOf;
    storePath = pkgs.llama-tree.outPath;
  };
  # the overlay on the stand-in package set (no CUDA in its config), and callPackage's
  # override of package.nix
  overlay = llamafile ((outputs.overlays.default stubPkgs stubPkgs).rollkv-llamafile);
  overlayCuda =
    let
      cudaPkgs = import ./. {
        inherit system;
        config.cudaSupport = true;
      };
    in
    llamafile ((outputs.overlays.default cudaPkgs cudaPkgs).rollkv-llamafile);
  overridden = llamafile (pkgs.cpu.override { cudaSupport = true; });
  rollkvOutPath = pkgs.rollkv.outPath;
  devShell = {
    inputsFrom = map (d: d.outPath) shell.shellArgs.inputsFrom;
    packages = names shell.shellArgs.packages;
    pythonPackages = (builtins.head shell.shellArgs.packages).pythonPackages;
    shellHook = shell.shellArgs.shellHook;
  };
  checks = builtins.attrNames outputs.checks.${system};
  recipeTestScript = outputs.checks.${system}.recipe-test.script;
  cpuCheckOutPath = outputs.checks.${system}.cpu.outPath;
}
