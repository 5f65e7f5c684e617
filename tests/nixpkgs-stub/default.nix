# Test fixture: a stand-in for nixpkgs with the attributes flake.nix uses.
# Derivations are plain attribute sets that keep the arguments they were given
# (so tests can read them) and a fake store path; nothing is built or fetched.
{
  system ? "x86_64-linux",
  config ? { },
}:
let
  lib = import ./lib.nix;
  storePath = name: "/nix/store/${builtins.substring 0 32 (builtins.hashString "sha256" name)}-${name}";
  fakeDrv =
    name: attrs:
    attrs
    // {
      inherit name system;
      type = "derivation";
      outPath = storePath name;
    };
  mkDerivationWith =
    stdenvName: argsOrFun:
    let
      args = if builtins.isFunction argsOrFun then argsOrFun final else argsOrFun;
      final = fakeDrv "${args.pname}-${args.version}" (args // { inherit stdenvName; });
    in
    final;
  pythonPackageNames = [
    "requests"
    "nvidia-ml-py"
    "numpy"
    "matplotlib"
    "pytest"
    "nox"
    "jinja2"
    "pyyaml"
  ];
  ps = lib.genAttrs pythonPackageNames (n: fakeDrv "python3.12-${n}" { });
  # nixpkgs' callPackage: fill the function's arguments from the package set, keep
  # `.override` (here: call again with the arguments merged)
  callPackage =
    fn: args:
    let
      f = if builtins.isFunction fn then fn else import fn;
      result = f (builtins.intersectAttrs (builtins.functionArgs f) pkgs // args);
    in
    result // { override = newArgs: callPackage fn (args // newArgs); };
  pkgs = {
  inherit lib config system callPackage;
  stdenv.mkDerivation = mkDerivationWith "stdenv";
  fetchPypi = args: fakeDrv "${args.pname}-${args.version}.tar.gz" { fetchPypiArgs = args; };
  cmake = fakeDrv "cmake" { };
  ninja = fakeDrv "ninja" { };
  git = fakeDrv "git" { };
  python3 = fakeDrv "python3" {
    withPackages = f: fakeDrv "python3-env" { pythonPackages = map (p: p.name) (f ps); };
  };
  autoAddDriverRunpath = fakeDrv "auto-add-driver-runpath-hook" { };
  cudaPackages = {
    backendStdenv.mkDerivation = mkDerivationWith "cudaPackages.backendStdenv";
    cuda_nvcc = fakeDrv "cuda_nvcc" { };
    cuda_cccl = fakeDrv "cuda_cccl" { };
    cuda_cudart = fakeDrv "cuda_cudart" { };
    libcublas = fakeDrv "libcublas" { };
    cudaMajorMinorVersion = "12.9";
    flags.cmakeCudaArchitecturesString = "75;80;86;89;90;100;120";
  };
  writeShellApplication =
    {
      name,
      text,
      runtimeInputs ? [ ],
    }:
    fakeDrv name {
      inherit text runtimeInputs;
      meta.mainProgram = name;
    }
    // {
      # two scripts of one name are two store paths
      outPath = storePath "${builtins.substring 0 8 (builtins.hashString "sha256" text)}-${name}";
    };
  mkShell = args: fakeDrv "nix-shell" { shellArgs = args; };
  runCommand = name: env: script: fakeDrv name { inherit env script; };
  # the unpacked, patched source of a derivation
  srcOnly = drv: fakeDrv "${drv.name}-source" { srcOnlyOf = drv.outPath; };
  };
in
pkgs
