# Install rules for `cmake --install`: binaries, systemd unit, sysusers.d
# entry, example config, deploy docs and Grafana dashboards.
#
# Included from the top-level CMakeLists.txt after the memoffloadd and
# memoffloadctl targets exist. With CMAKE_INSTALL_PREFIX=/usr:
#   /usr/sbin/memoffloadd, /usr/bin/memoffloadctl
#   /usr/lib/systemd/system/memoffloadd.service
#   /usr/lib/sysusers.d/memoffload.conf
#   /etc/memoffload/memoffloadd.toml            (only if absent: never clobbered)
#   /usr/share/doc/memoffload/examples/memoffloadd.toml, .../deploy.md, .../running.md
#   /usr/share/memoffload/grafana/...
# The unit's /usr/sbin and /etc paths are rewritten for other prefixes (the
# config dir follows GNUInstallDirs: /usr/local -> /usr/local/etc, /opt/X ->
# /etc/opt/X).
include(GNUInstallDirs)

set(_memoffload_root "${CMAKE_CURRENT_LIST_DIR}/..")
set(MEMOFFLOAD_SYSTEMD_UNIT_DIR "lib/systemd/system" CACHE STRING
    "Where the systemd unit goes (relative to the prefix, or absolute)")
set(MEMOFFLOAD_SYSUSERS_DIR "lib/sysusers.d" CACHE STRING
    "Where the sysusers.d file goes (relative to the prefix, or absolute)")

install(TARGETS memoffloadd RUNTIME DESTINATION ${CMAKE_INSTALL_SBINDIR})
install(TARGETS memoffloadctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# The unit names /usr/sbin/memoffloadd and /etc/memoffload; point it at the
# install locations. It is read at configure time: an edit re-runs CMake.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             "${_memoffload_root}/deploy/systemd/memoffloadd.service")
file(READ "${_memoffload_root}/deploy/systemd/memoffloadd.service" _memoffload_unit)
string(REPLACE "/usr/sbin/memoffloadd" "${CMAKE_INSTALL_FULL_SBINDIR}/memoffloadd"
       _memoffload_unit "${_memoffload_unit}")
string(REPLACE "/etc/memoffload/" "${CMAKE_INSTALL_FULL_SYSCONFDIR}/memoffload/"
       _memoffload_unit "${_memoffload_unit}")
file(GENERATE OUTPUT "${CMAKE_BINARY_DIR}/deploy/memoffloadd.service"
     CONTENT "${_memoffload_unit}")
install(FILES "${CMAKE_BINARY_DIR}/deploy/memoffloadd.service"
        DESTINATION ${MEMOFFLOAD_SYSTEMD_UNIT_DIR})
install(FILES "${_memoffload_root}/deploy/systemd/memoffload.sysusers.conf"
        DESTINATION ${MEMOFFLOAD_SYSUSERS_DIR} RENAME memoffload.conf)

# Example config: always under the doc dir; under /etc only when no config is
# there yet, so that reinstalling never overwrites an operator's settings.
set(_memoffload_example "${_memoffload_root}/deploy/systemd/memoffloadd.toml")
install(FILES "${_memoffload_example}" DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples)
install(FILES "${_memoffload_root}/docs/deploy.md" "${_memoffload_root}/docs/running.md"
        DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(CODE "
  set(_dest \"\$ENV{DESTDIR}${CMAKE_INSTALL_FULL_SYSCONFDIR}/memoffload/memoffloadd.toml\")
  if(EXISTS \"\${_dest}\")
    message(STATUS \"Keeping existing: \${_dest}\")
  else()
    file(INSTALL DESTINATION \"${CMAKE_INSTALL_FULL_SYSCONFDIR}/memoffload\"
         TYPE FILE FILES \"${_memoffload_example}\")
  endif()
")

install(DIRECTORY "${_memoffload_root}/grafana/"
        DESTINATION ${CMAKE_INSTALL_DATADIR}/memoffload/grafana)
