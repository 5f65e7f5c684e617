# rollkv-llamafile: llama.cpp (as vendored in the pinned llama-cpp-python sdist) with the
# rollkv patch series, for nixpkgs' callPackage, in the style of nixpkgs' llama-cpp:
#
#   pkgs.callPackage ./package.nix { }                      # CUDA when config.cudaSupport
#   pkgs.callPackage ./package.nix { cudaSupport = true; }  # needs allowUnfree (CUDA licence)
#   (pkgs.callPackage ./package.nix { }).override { cudaSupport = false; }
#   pkgs.callPackage ./package.nix { rpcSupport = false; }   # without the RPC backend and ggml-rpc-server
#
# The pin (rollkv_dist/pin.toml) and the series (patches/series) are read from this checkout;
# the build is rollkv's one build definition (rollkv_dist/cmake/): the initial cache
# rollkv.cmake, the target rollkv-programs, the install rule rollkv-install.cmake, as in
# `rollkv build` and recipe/build.sh.
{
  lib,
  config,
  stdenv,
  fetchPypi,
  cmake,
  ninja,
  python3,
  runCommand,
  autoAddDriverRunpath,
  cudaSupport ? config.cudaSupport or false,
  # nixpkgs' llama-cpp name; on in the one build definition (rollkv.cmake's GGML_RPC)
  rpcSupport ? true,
  cudaPackages ? { },
}:
let
  # The one pin: rollkv_dist/pin.toml, read here rather than copied.
  pinFile = builtins.fromTOML (builtins.readFile ./rollkv_dist/pin.toml);
  pinField =
    name:
    if builtins.isString (pinFile.${name} or null) then
      pinFile.${name}
    else
      throw "rollkv_dist/pin.toml: expected a string ${name} = \"...\"";
  pin = rec {
    project = pinField "project";
    version = pinField "version";
    sri = pinField "sri";
    tree = pinField "tree";
    llamaCommit = pinField "llama_commit";
    llamaVersion = pinField "llama_version";
    # the sdist file name normalizes the project name: llama_cpp_python-0.3.36.tar.gz
    sdistName = builtins.replaceStrings [ "-" ] [ "_" ] project;
    sdistRoot = "${sdistName}-${version}";
  };

  # The patch series, in the order of patches/series (blank lines and "#" comments skipped,
  # as rollkv_dist.series.read_series reads it; tests/test_flake_eval.py checks they agree).
  seriesNames = builtins.filter (n: n != "") (
    map (l: lib.trim (builtins.head (lib.splitString "#" l))) (
      lib.splitString "\n" (builtins.readFile ./patches/series)
    )
  );
  seriesPatches = map (n: ./patches + "/${n}") seriesNames;
  buildCommit = "${pin.llamaCommit}+rollkv.${toString (builtins.length seriesNames)}";
  # one version for every artifact: the conda package's (rollkv_dist.series.package_version):
  # <llama_version>.dev+<llama_commit>.rollkv<N>; the sdist keeps its own version in fetchPypi
  packageVersion = "${pin.llamaVersion}.dev+${pin.llamaCommit}.rollkv${toString (builtins.length seriesNames)}";

  # rollkv_dist (the series tool, standard library only, and the CMake build definition)
  toolSrc = builtins.path {
    path = ./rollkv_dist;
    name = "rollkv_dist";
    filter = path: type: baseNameOf path != "__pycache__";
  };
  tool = runCommand "rollkv-tool" { } ''
    mkdir -p $out
    cp -r ${toolSrc} $out/rollkv_dist
  '';
  cmakeDir = "${tool}/rollkv_dist/cmake";
  series = "PYTHONPATH=${tool} python3 -m rollkv_dist.series";
in
# nvcc caps the host compiler; cudaPackages.backendStdenv is the matching one
(if cudaSupport then cudaPackages.backendStdenv else stdenv).mkDerivation (finalAttrs: {
  pname = "rollkv-llamafile" + lib.optionalString cudaSupport "-cuda";
  version = packageVersion;

  src = fetchPypi {
    pname = pin.sdistName;
    inherit (pin) version;
    hash = pin.sri;
  };
  # llama.cpp as vendored in the sdist; the series is relative to it
  sourceRoot = "${pin.sdistRoot}/${pin.tree}";
  patches = seriesPatches;

  # byte-identical check against patches/manifest.json (the series tool, as in the recipe)
  postPatch = ''
    ${series} verify . ${./patches}
  '';

  nativeBuildInputs = [
    cmake
    ninja
    python3
  ]
  ++ lib.optionals cudaSupport [
    cudaPackages.cuda_nvcc
    autoAddDriverRunpath
  ];

  buildInputs = lib.optionals cudaSupport [
    cudaPackages.cuda_cccl
    cudaPackages.cuda_cudart
    cudaPackages.libcublas
  ];

  cmakeFlags = [
    "-C${cmakeDir}/rollkv.cmake"
    (lib.cmakeFeature "LLAMA_BUILD_COMMIT" buildCommit)
    (lib.cmakeBool "GGML_CUDA" cudaSupport)
  ]
  ++ lib.optionals (!rpcSupport) [ (lib.cmakeBool "GGML_RPC" false) ]
  ++ lib.optionals cudaSupport [
    # nixpkgs' idiom: config.cudaCapabilities (default: the toolkit's list)
    (lib.cmakeFeature "CMAKE_CUDA_ARCHITECTURES" cudaPackages.flags.cmakeCudaArchitecturesString)
  ];

  # the programs and what they link, nothing else (rollkv.cmake's target)
  ninjaFlags = [ "rollkv-programs" ];

  installPhase = ''
    runHook preInstall
    cmake -DROLLKV_BUILD_DIR=. -DCMAKE_INSTALL_PREFIX=$out -P ${cmakeDir}/rollkv-install.cmake
    runHook postInstall
  '';

  # which changes this binary carries, like the conda package and `rollkv build`
  postInstall = ''
    ${series} record ${./patches} $out version=${packageVersion} build_number=0 \
      build_commit=${buildCommit} \
      cuda=${if cudaSupport then cudaPackages.cudaMajorMinorVersion else "None"} \
      "targets=$(tr ';' ' ' < rollkv-programs.txt)"
  '';

  passthru = {
    inherit pin seriesNames buildCommit cudaSupport;
  };

  meta = {
    description = "llama.cpp with rolling KV (KV cache partly on the GPU, host tail in pinned memory)";
    license = lib.licenses.mit;
    platforms = lib.platforms.linux;
    mainProgram = "llama-server";
  };
})
