{
  description = "rollkv: llama.cpp with rolling KV (pinned upstream + patches/series)";

  # nixos-unstable as of 2026-06-29 (lastModified 1782723713); flake.lock
  # records its narHash. Move it with `nix flake update` and commit both files.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/b5aa0fbd538984f6e3d201be0005b4463d8b09f8";

  outputs =
    { self, nixpkgs }:
    let
      inherit (nixpkgs) lib;

      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      forAllSystems = f: lib.genAttrs systems f;

      # The one pin: rollkv_dist/pin.py, read here rather than copied.
      pinLines = lib.splitString "\n" (builtins.readFile ./rollkv_dist/pin.py);
      pinField =
        name:
        let
          pattern = "[[:space:]]*${name}=\"([^\"]*)\",?[[:space:]]*";
          hits = builtins.filter (l: builtins.match pattern l != null) pinLines;
        in
        if builtins.length hits == 1 then
          builtins.head (builtins.match pattern (builtins.head hits))
        else
          throw "rollkv_dist/pin.py: expected one ${name}=\"...\" line, found ${toString (builtins.length hits)}";
      pin = rec {
        project = pinField "project";
        version = pinField "version";
        sri = pinField "sri";
        tree = pinField "tree";
        llamaCommit = pinField "llama_commit";
        # the sdist file name normalizes the project name: llama_cpp_python-0.3.36.tar.gz
        sdistName = builtins.replaceStrings [ "-" ] [ "_" ] project;
        sdistRoot = "${sdistName}-${version}";
      };

      # The patch series, in the order of patches/series (blank lines and
      # "#" comments skipped, as quilt and rollkv read it).
      seriesNames = builtins.filter (n: n != "") (
        map (l: lib.trim (builtins.head (lib.splitString "#" l))) (
          lib.splitString "\n" (builtins.readFile ./patches/series)
        )
      );
      seriesPatches = map (n: ./patches + "/${n}") seriesNames;

      pkgsFor =
        system: cuda:
        if cuda then
          import nixpkgs {
            inherit system;
            config = {
              allowUnfree = true; # the CUDA toolkit's licence
              cudaSupport = true;
            };
          }
        else
          nixpkgs.legacyPackages.${system};

      mkLlamafile =
        pkgs:
        {
          cudaSupport ? pkgs.config.cudaSupport or false,
          cudaPackages ? pkgs.cudaPackages,
          autoAddDriverRunpath ? pkgs.autoAddDriverRunpath,
        }:
        let
          inherit (pkgs) stdenv;
          cmakeFlag = name: value: lib.cmakeFeature name value;
        in
        # nvcc caps the host compiler; cudaPackages.backendStdenv is the matching one
        (if cudaSupport then cudaPackages.backendStdenv else stdenv).mkDerivation (finalAttrs: {
          pname = "rollkv-llamafile" + lib.optionalString cudaSupport "-cuda";
          version = pin.version;

          src = pkgs.fetchPypi {
            pname = pin.sdistName;
            inherit (pin) version;
            hash = pin.sri;
          };
          # llama.cpp as vendored in the sdist; the series is relative to it
          sourceRoot = "${pin.sdistRoot}/${pin.tree}";
          patches = seriesPatches;

          # byte-identical check against patches/manifest.json (same script as
          # the conda build)
          postPatch = ''
            python3 ${./recipe/verify_manifest.py} . ${./patches}
          '';

          nativeBuildInputs = [
            pkgs.cmake
            pkgs.ninja
            pkgs.python3
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
            (lib.cmakeBool "BUILD_SHARED_LIBS" true)
            (lib.cmakeBool "LLAMA_BUILD_TESTS" false)
            (lib.cmakeBool "LLAMA_BUILD_EXAMPLES" false)
            (lib.cmakeBool "LLAMA_BUILD_APP" false)
            (lib.cmakeBool "LLAMA_BUILD_TOOLS" true)
            (lib.cmakeBool "LLAMA_BUILD_SERVER" true)
            # offline-safe: no UI download or npm, no HTTPS client, no NCCL
            (lib.cmakeBool "LLAMA_BUILD_UI" false)
            (lib.cmakeBool "LLAMA_USE_PREBUILT_UI" false)
            (lib.cmakeBool "LLAMA_OPENSSL" false)
            (cmakeFlag "LLAMA_BUILD_NUMBER" "0")
            (cmakeFlag "LLAMA_BUILD_COMMIT" "${pin.llamaCommit}+rollkv.${toString (builtins.length seriesNames)}")
            (lib.cmakeBool "GGML_NATIVE" false)
            (lib.cmakeBool "GGML_CUDA" cudaSupport)
          ]
          ++ lib.optionals cudaSupport [
            (lib.cmakeBool "GGML_CUDA_NCCL" false)
            # from nixpkgs' config.cudaCapabilities (default: the toolkit's list)
            (cmakeFlag "CMAKE_CUDA_ARCHITECTURES" cudaPackages.flags.cmakeCudaArchitecturesString)
          ];

          # which changes this binary carries, like the conda package
          postInstall = ''
            share=$out/share/rollkv-llamafile
            mkdir -p $share/patches
            cp ${./patches/series} $share/series
            ${lib.concatMapStrings (p: "cp ${p} $share/patches/${baseNameOf (toString p)}\n") seriesPatches}
            printf '%s\n' version=${pin.version} build_number=0 llama_commit=${pin.llamaCommit} \
              cuda=${if cudaSupport then cudaPackages.cudaMajorMinorVersion else "None"} targets=all \
              > $share/build-info.txt
          '';

          passthru = {
            inherit pin seriesNames cudaSupport;
          };

          meta = {
            description = "llama.cpp with rolling KV (KV cache partly on the GPU, host tail in pinned memory)";
            license = lib.licenses.mit;
            platforms = lib.platforms.linux;
            mainProgram = "llama-server";
          };
        });

      python = pkgs: pkgs.python3.withPackages (ps: [
        ps.requests
        ps.nvidia-ml-py
        ps.numpy
        ps.matplotlib
      ]);

      # `rollkv` from this checkout, with the CUDA build's programs on PATH
      rollkvTool =
        pkgs: llamafile:
        pkgs.writeShellApplication {
          name = "rollkv";
          runtimeInputs = [
            (python pkgs)
            llamafile
          ];
          text = ''
            export PYTHONPATH=${self}''${PYTHONPATH:+:$PYTHONPATH}
            exec python3 -m rollkv_dist "$@"
          '';
        };
    in
    {
      packages = forAllSystems (
        system:
        let
          cpu = mkLlamafile (pkgsFor system false) { cudaSupport = false; };
          cuda = mkLlamafile (pkgsFor system true) { cudaSupport = true; };
        in
        {
          default = cuda;
          inherit cpu cuda;
          rollkv = rollkvTool (pkgsFor system true) cuda;
          # `nix run .#gates -- [rollkv gates options]`: the GPU gates against
          # the CUDA build (--build is this flake's package)
          gates = (pkgsFor system false).writeShellApplication {
            name = "rollkv-gates";
            runtimeInputs = [ self.packages.${system}.rollkv ];
            text = ''exec rollkv gates --build ${cuda} "$@"'';
          };
        }
      );

      apps = forAllSystems (
        system:
        let
          pkgs = self.packages.${system};
        in
        {
          default = {
            type = "app";
            program = lib.getExe pkgs.default;
          };
          cpu = {
            type = "app";
            program = lib.getExe pkgs.cpu;
          };
          gates = {
            type = "app";
            program = lib.getExe pkgs.gates;
          };
        }
      );

      devShells = forAllSystems (
        system:
        let
          pkgs = pkgsFor system true;
        in
        {
          default = pkgs.mkShell {
            inputsFrom = [ self.packages.${system}.cuda ];
            packages = [
              (pkgs.python3.withPackages (ps: [
                ps.requests
                ps.nvidia-ml-py
                ps.numpy
                ps.matplotlib
                ps.pytest
                ps.nox
                ps.jinja2
                ps.pyyaml
              ]))
              pkgs.git
            ];
            shellHook = ''
              export CUDA_DEVICE_ORDER=PCI_BUS_ID
            '';
          };
        }
      );

      checks = forAllSystems (
        system:
        let
          pkgs = pkgsFor system false;
          cpu = self.packages.${system}.cpu;
        in
        {
          inherit cpu;
          # the conda recipe's own test, run against the Nix build
          recipe-test = pkgs.runCommand "rollkv-llamafile-recipe-test" { } ''
            PREFIX=${cpu} bash ${./recipe/run_test.sh}
            touch $out
          '';
        }
      );
    };
}
